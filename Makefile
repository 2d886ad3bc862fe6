PYTHON ?= python3
VERISPEC_HOME ?= $(HOME)/.cache/verispec

.PHONY: setup install install-llamacpp models test test-fast browser-deps

# Install the package into the current Python environment (torch pinned to 2.13.0, CPU), pull the default
# model pair and the small test model, and try the optional llama.cpp backend: a failed llama.cpp build
# prints a warning and leaves the default pair (transformers) working.
setup: install models
	@$(MAKE) --no-print-directory install-llamacpp || \
	  echo "verispec: warning: the optional llama.cpp backend did not build; everything else works" \
	       "(retry with 'make install-llamacpp')" >&2

install:
	$(PYTHON) -m pip install -q -e '.[test]'

# The llama.cpp backend (the [llamacpp] extra), compiled for this CPU (-march=native) and built without AMX:
# llama.cpp's AMX kernels die with SIGILL (tilezero) on VMs whose CPUs list AMX. The built wheel is kept
# under $(VERISPEC_HOME)/wheels, keyed by version, flags, Python and the CPU's feature flags, so that a
# fresh environment on the same machine installs it in seconds instead of compiling for ~7 minutes.
LLAMA_CPP_VERSION = 0.3.36
NO_AMX = -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_KEY := $(shell { $(PYTHON) -c 'import sys; print(sys.implementation.cache_tag)'; echo '$(NO_AMX)'; \
               grep -m1 '^flags' /proc/cpuinfo; } 2>/dev/null | md5sum | cut -c1-12)
LLAMA_WHEELS = $(VERISPEC_HOME)/wheels/llama-cpp-python-$(LLAMA_CPP_VERSION)-$(LLAMA_KEY)
install-llamacpp:
	@if $(PYTHON) -c "import llama_cpp" 2>/dev/null; then echo "llama-cpp-python already installed"; exit 0; fi; \
	set -e; \
	if ! ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1; then \
	  echo "building llama-cpp-python $(LLAMA_CPP_VERSION) for this CPU (~7 min)"; \
	  rm -rf $(LLAMA_WHEELS).partial; \
	  CMAKE_ARGS="-DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'" \
	    $(PYTHON) -m pip wheel -q --no-deps --no-cache-dir -w $(LLAMA_WHEELS).partial \
	    'llama-cpp-python==$(LLAMA_CPP_VERSION)'; \
	  mv $(LLAMA_WHEELS).partial $(LLAMA_WHEELS); \
	fi; \
	$(PYTHON) -m pip install -q $(LLAMA_WHEELS)/llama_cpp_python-*.whl

models:
	$(PYTHON) -m verispec.cli models pull
	$(PYTHON) -m verispec.cli models pull smollm2-135m-instruct

# The unit tests run on tiny in-process models, one thread each (tests/conftest.py), so they run in parallel:
# one pytest-xdist worker per core (at most 8), a test file per worker at a time (its module fixtures built
# once). The integration tests give every core to one real model and run after them, one at a time.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 8 ] && n=8; echo $$n)
UNIT_TESTS = HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not integration"

# The whole suite: the unit tests, then the integration tests on the real models (both run; either failing
# fails). The chat page's browser test needs chromium, chromedriver and selenium: installed first where apt
# can (root, or sudo without a password); elsewhere that test skips and says why.
test:
	@$(MAKE) --no-print-directory browser-deps || echo "verispec: browser test dependencies not installed;" \
	  "tests/test_browser.py will skip" >&2
	$(UNIT_TESTS); unit=$$?; HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q -m integration; integration=$$?; \
	  [ $$unit -eq 0 ] && [ $$integration -eq 0 ]

# chromium + chromedriver (apt) and selenium (pip), each only when missing.
browser-deps:
	@if ! command -v chromedriver >/dev/null 2>&1 || \
	    ! { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; }; then \
	  if ! command -v apt-get >/dev/null 2>&1; then echo "browser-deps: no apt-get here" >&2; exit 1; fi; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	  else echo "browser-deps: apt-get needs root" >&2; exit 1; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium \
	    chromium-driver >/dev/null; \
	fi
	@$(PYTHON) -c "import selenium" 2>/dev/null || $(PYTHON) -m pip install -q 'selenium>=4.10'

# Unit tests only (no model files needed).
test-fast:
	$(UNIT_TESTS)
