PYTHON ?= python3
VERISPEC_HOME ?= $(HOME)/.cache/verispec

.PHONY: setup install install-llamacpp llamacpp-wheel models test test-fast browser-deps

# Install the package and its extras (serve, bench, test) into the current Python environment (torch pinned to
# 2.13.0, CPU) and pull the models the defaults use: the default pair and SmolLM2-135M (llama.cpp's draft for one user
# and the tests' small model; GGUFs and tokenizers; transformers' bf16 copies are made on first use) while
# the optional llama.cpp backend compiles beside them (it needs neither); then install it. A failed llama.cpp
# build prints its last lines and a warning, and the default pair runs on transformers; a failed install or pull,
# or an interrupt, stops the build too (setsid: it runs in a process group of its own, whatever the shell).
# Each part prints its time.
setup:
	@start=$$(date +%s); log=$$(mktemp /tmp/verispec-llama-build.XXXXXX); \
	since() { echo "verispec: $$1 ($$(( $$(date +%s) - start )) s)" >&2; }; \
	echo "verispec: llama.cpp with verispec's kernels compiles in the background unless built (log: $$log)" >&2; \
	$$(command -v setsid) $(MAKE) --no-print-directory llamacpp-wheel >$$log 2>&1 & build=$$!; \
	stop() { kill -TERM -- -$$build 2>/dev/null; wait $$build; rm -f $$log; }; \
	trap 'stop; exit 130' INT TERM; \
	if ! { $(MAKE) --no-print-directory install && since "package installed" && \
	       $(MAKE) --no-print-directory models && since "models pulled"; }; then stop; exit 1; fi; \
	if wait $$build && $(MAKE) --no-print-directory install-llamacpp; then since "llama.cpp backend installed"; \
	else tail -n 20 $$log >&2; echo "verispec: warning: the optional llama.cpp backend did not build; everything" \
	  "else works, on transformers (retry with 'make install-llamacpp')" >&2; fi; \
	rm -f $$log

install:
	$(PYTHON) -m pip install -q -e '.[serve,bench,test]'

# The llama.cpp backend (the [llamacpp] extra): llama-cpp-python's source with verispec's kernel patch
# (native/llama.cpp-kernels.patch: multi-column kernels that make a verification pass over a few tokens cost
# little more than one token, and batch-invariant switches), compiled for this CPU (-march=native), without the
# multimodal library and llama.cpp's common library and HTTP client beneath it (mtmd: llama-cpp-python loads it
# only for image chat, which verispec does not use; nothing else loads the common library). AMX is
# left out unless LLAMA_AMX=1 and native/amx_probe.c runs AMX tiles here (its one-line reason is printed
# otherwise). The built wheel is kept under $(VERISPEC_HOME)/wheels, keyed by the version, the patch, the
# flags, Python and the CPU's feature flags, so that a fresh environment on the same machine installs it in
# seconds instead of compiling for minutes; the build reports its key (VERISPEC_BUILD in llama.cpp's
# system info), so an installed llama-cpp-python built otherwise is replaced. The wheel's own dependencies are
# installed after it, and a llama-cpp-python that then fails to import is removed again, so that the default
# pair falls back to transformers. `llamacpp-wheel` only builds the wheel (no environment needed beyond pip).
LLAMA_CPP_VERSION = 0.3.36
LLAMA_PATCH = native/llama.cpp-kernels.patch
LLAMA_AMX ?= 0
NO_AMX = -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_BUILD_DIR := $(shell mktemp -u /tmp/verispec-llama.XXXXXX)
LLAMA_AMX_FLAGS := $(shell if [ "$(LLAMA_AMX)" = 1 ]; then d=$$(mktemp -d); \
                     if ! cc -O1 -mamx-tile -mamx-int8 native/amx_probe.c -o $$d/probe 2>/dev/null; then \
                       echo "verispec: AMX left out: the compiler cannot build AMX code" >&2; echo '$(NO_AMX)'; \
                     elif r=$$($$d/probe); then echo AMX; \
                     else echo "verispec: AMX left out: $$r" >&2; echo '$(NO_AMX)'; fi; rm -rf "$$d"; \
                     else echo '$(NO_AMX)'; fi)
LLAMA_KEY := $(shell { $(PYTHON) -c 'import sys; print(sys.implementation.cache_tag)'; echo '$(LLAMA_AMX_FLAGS)'; \
               cat $(LLAMA_PATCH); grep -m1 '^flags' /proc/cpuinfo; } 2>/dev/null | md5sum | cut -c1-12)
LLAMA_CFLAGS = $(filter-out AMX,$(LLAMA_AMX_FLAGS)) -DVERISPEC_BUILD_KEY=$(LLAMA_KEY)
LLAMA_WHEELS = $(VERISPEC_HOME)/wheels/llama-cpp-python-$(LLAMA_CPP_VERSION)-$(LLAMA_KEY)
LLAMA_INSTALLED = $(PYTHON) -c "import llama_cpp, sys; sys.exit(b'VERISPEC_BUILD = $(LLAMA_KEY) ' not in \
	  llama_cpp.llama_print_system_info())" 2>/dev/null
llamacpp-wheel:
	@if ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || $(LLAMA_INSTALLED); then exit 0; fi; \
	set -e; \
	echo "building llama-cpp-python $(LLAMA_CPP_VERSION) with verispec's kernels for this CPU"; \
	rm -rf $(LLAMA_WHEELS).partial $(LLAMA_BUILD_DIR); mkdir -p $(LLAMA_BUILD_DIR); \
	trap 'rm -rf $(LLAMA_BUILD_DIR)' EXIT; \
	$(PYTHON) -m pip download -q --no-deps --no-binary :all: -d $(LLAMA_BUILD_DIR) \
	  'llama-cpp-python==$(LLAMA_CPP_VERSION)'; \
	tar xzf $(LLAMA_BUILD_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(LLAMA_BUILD_DIR); \
	patch -s -p1 -d $(LLAMA_BUILD_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp < $(LLAMA_PATCH); \
	sed -i 's/set(LLAMA_BUILD_COMMON ON CACHE/set(LLAMA_BUILD_COMMON OFF CACHE/' \
	  $(LLAMA_BUILD_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION)/CMakeLists.txt; \
	CMAKE_ARGS="-DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS='$(LLAMA_CFLAGS)' -DCMAKE_CXX_FLAGS='$(LLAMA_CFLAGS)'" \
	  $(PYTHON) -m pip wheel -q --no-deps --no-cache-dir -w $(LLAMA_WHEELS).partial \
	  $(LLAMA_BUILD_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION); \
	mv $(LLAMA_WHEELS).partial $(LLAMA_WHEELS)

install-llamacpp:
	@if $(LLAMA_INSTALLED); then echo "llama-cpp-python already installed"; exit 0; fi; \
	set -e; \
	$(MAKE) --no-print-directory llamacpp-wheel; \
	$(PYTHON) -m pip install -q --force-reinstall --no-deps $(LLAMA_WHEELS)/llama_cpp_python-*.whl; \
	$(PYTHON) -m pip install -q $(LLAMA_WHEELS)/llama_cpp_python-*.whl; \
	$(PYTHON) -c "import llama_cpp" || { $(PYTHON) -m pip uninstall -q -y llama-cpp-python; exit 1; }

models:
	$(PYTHON) -m verispec.apps.cli models pull

# The unit tests run on tiny models, one thread each (in process, and the servers they start: tests/conftest.py),
# so they run in parallel: one pytest-xdist worker per core (at most 8; each pinned to its core), a test file per
# worker at a time (its module fixtures built once); a distribution test decodes its thousands of seeded
# generations eight at a time (tests/stats_util.py). The integration tests run after them (below).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 8 ] && n=8; echo $$n)
UNIT_TESTS = HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not integration"
# The integration tests' files on two workers, each on half the cores (tests/conftest.py pins them): a file's real
# models load once in its worker, and while one waits on a process start, a load or Python the other computes.
# Two, not one per core: each worker holds its files' models (the transformers fp32 target alone is 6 GB).
INTEGRATION_WORKERS ?= $(shell [ $(TEST_WORKERS) -gt 1 ] && echo 2 || echo 0)
INTEGRATION_TESTS = HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q -n $(INTEGRATION_WORKERS) --dist loadfile -m integration

# The whole suite: the unit tests, then the integration tests on the real models (both run; either failing
# fails). The chat page's browser test needs chromium, chromedriver and selenium: installed first where apt
# can (root, or sudo without a password); elsewhere that test skips and says why.
test:
	@$(MAKE) --no-print-directory browser-deps || echo "verispec: browser test dependencies not installed;" \
	  "tests/apps/test_browser.py will skip" >&2
	$(UNIT_TESTS); unit=$$?; $(INTEGRATION_TESTS); integration=$$?; \
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
