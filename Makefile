PYTHON ?= python3

.PHONY: setup install models test test-fast

# Install the package (torch pinned to 2.13.0, CPU) and pull the default model pair + the small test model.
setup: install models

install:
	$(PYTHON) -m pip install -q -e '.[test]'

models:
	verispec models pull
	verispec models pull smollm2-135m-instruct

# The whole suite: unit tests on tiny in-process models, then integration tests on the real models.
test:
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q

# Unit tests only (seconds to a minute, no model files needed).
test-fast:
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q -m "not integration"
