PYTHON ?= python3

.PHONY: setup install install-llamacpp models test test-fast

# Install the package (torch pinned to 2.13.0, CPU) and pull the default model pair + the small test model.
setup: install install-llamacpp models

install:
	$(PYTHON) -m pip install -q -e '.[test]'

# The llama.cpp backend (the [llamacpp] extra), built from source for this CPU. Built without AMX: llama.cpp's
# AMX kernels die with SIGILL (tilezero) on VMs whose CPUs list AMX. Skipped when already installed.
LLAMA_CPP_PYTHON = llama-cpp-python==0.3.36
NO_AMX = -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
install-llamacpp:
	$(PYTHON) -c "import llama_cpp" 2>/dev/null || \
	  CMAKE_ARGS="-DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'" \
	  $(PYTHON) -m pip install -q --no-cache-dir '$(LLAMA_CPP_PYTHON)'

models:
	verispec models pull
	verispec models pull smollm2-135m-instruct

# The whole suite: unit tests on tiny in-process models, then integration tests on the real models.
test:
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q

# Unit tests only (seconds to a minute, no model files needed).
test-fast:
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q -m "not integration"
