PYTHON ?= python3
VERISPEC_HOME ?= $(HOME)/.cache/verispec

.PHONY: setup install install-llamacpp models test test-fast

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

# The whole suite: unit tests on tiny in-process models, then integration tests on the real models.
test:
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q

# Unit tests only (seconds to a minute, no model files needed).
test-fast:
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q -m "not integration"
