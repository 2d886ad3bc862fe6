#!/usr/bin/env bash
# verispec's multi-column kernels (native/llama.cpp-kernels.patch) alone, one thread, on random weight blocks of
# the default target's shapes: per width, milliseconds a call and GMAC/s a core, for repacked Q4_K and for Q6_K,
# and for quantizing the width's activations to Q8_K (G values/s).
# CANDIDATE=path/to/multicol.cpp compiles that file as the candidate: checked bitwise against the patched
# kernels at every width and timed beside them, the two taking turns (default: the patched file against itself);
# the candidate defines every function multicol.h declares.
#
#   bash bench/multicol_kernels.sh                 # widths 1,2,5,9,16,24,36,64 (WIDTHS), 5 repeats (REPEATS)
#   CANDIDATE=/tmp/multicol.cpp bash bench/multicol_kernels.sh
#
# Needs pip (the llama-cpp-python 0.3.36 source is fetched from the package index into a temporary folder), g++
# and an x86 CPU with AVX2. Takes about a minute.
set -euo pipefail
candidate=${CANDIDATE:+$(realpath "$CANDIDATE")}  # before the cd: a path relative to where it was run
cd "$(dirname "$0")/.."
repo=$PWD
python=${PYTHON:-python}
version=$(sed -n 's/^LLAMA_CPP_VERSION = //p' Makefile)  # the llama.cpp `make install-llamacpp` patches
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
WIDTHS=${WIDTHS:-1,2,5,9,16,24,36,64}
REPEATS=${REPEATS:-5}
"$python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src=$work/llama_cpp_python-$version/vendor/llama.cpp
patch -s -d "$src" -p1 < "$repo/native/llama.cpp-kernels.patch"
flags=(-O3 -march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -std=c++17 -w
       -I"$src/ggml/include" -I"$src/ggml/src" -I"$src/ggml/src/ggml-cpu")
compile() {  # $1 source, $2 prefix for the kernels' names, $3 object
    g++ "${flags[@]}" -Dggml_multicol_q4_K_8x8_q8_K="$2_q4" -Dggml_multicol_q6_K_q8_K="$2_q6" \
        -Dggml_verispec_build="$2_build" -Dggml_multicol_wanted="$2_wanted" -Dggml_multicol_available="$2_available" \
        -Dggml_multicol_isa="$2_isa" -Dggml_fa_tiled_enabled="$2_fa_tiled" -Dggml_batch_invariant="$2_invariant" \
        -Dggml_fa_split_kv_enabled="$2_split_kv" -Dggml_multicol_quantize_q8_K="$2_quantize" -c "$1" -o "$3"
}
compile "$src/ggml/src/ggml-cpu/multicol.cpp" ref "$work/ref.o"
compile "${candidate:-$src/ggml/src/ggml-cpu/multicol.cpp}" new "$work/new.o"
g++ "${flags[@]}" bench/multicol_kernels.cpp "$work/ref.o" "$work/new.o" -o "$work/multicol_kernels"
cpu=$("$python" -c "import os; print(min(os.sched_getaffinity(0)))")  # one core the process may run on
echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs); one thread on CPU $cpu"
# the rows of the attention and FFN inputs (1536 wide), and the FFN down projection's (8960)
taskset -c "$cpu" "$work/multicol_kernels" "$WIDTHS" "$REPEATS" 1536:1024 8960:256
