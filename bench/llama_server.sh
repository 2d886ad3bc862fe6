# Sourced by the scripts that measure verispec serve against llama.cpp's own llama-server: building llama-server
# and running one server at a time. Needs $python (the interpreter with verispec) and $out (where server logs go),
# and runs from the repository's root.
#
# llama_server_build KERNELS: builds llama-server from the llama.cpp source that llama-cpp-python's sdist vendors
# (the commit verispec runs; KERNELS=verispec applies native/llama.cpp-kernels.patch), without AMX as the Makefile
# builds verispec's, once, under $VERISPEC_HOME/llama-server/VERSION-KERNELS-noamx; sets $llama_server to it.
# server_start NAME COMMAND...: starts COMMAND --host 127.0.0.1 --port PORT (a free one), its output in
# $out/NAME.log, and waits for GET /health to answer 200; sets $url and $pid. server_stop: stops it.

llama_server_build() {
    local kernels="$1" home="${VERISPEC_HOME:-$HOME/.cache/verispec}" version src llama
    version="$("$python" -c "import re; print(re.search(r'LLAMA_CPP_VERSION = (\S+)', open('Makefile').read())[1])")"
    local dir="$home/llama-server/$version-$kernels-noamx"
    llama_server="$dir/llama-server"
    [ -x "$llama_server" ] && return 0
    src="$(mktemp -d)"
    echo "building llama-server from llama-cpp-python $version's llama.cpp ($kernels kernels)" >&2
    "$python" -m pip download -q --no-deps --no-binary :all: -d "$src" "llama-cpp-python==$version"
    tar xzf "$src/llama_cpp_python-$version.tar.gz" -C "$src"
    llama="$src/llama_cpp_python-$version/vendor/llama.cpp"
    if [ "$kernels" = verispec ]; then patch -s -p1 -d "$llama" < native/llama.cpp-kernels.patch; fi
    # without AMX, as the Makefile builds verispec's llama.cpp (LLAMA_AMX=0): a VM may list AMX yet refuse its tiles
    local flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    if ! cmake -S "$llama" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
            -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
            >"$src/cmake.log" 2>&1 ||
       ! cmake --build "$src/build" --target llama-server -j "$(nproc)" >"$src/build.log" 2>&1; then
        tail -20 "$src"/*.log >&2
        rm -rf "$src"
        return 1
    fi
    mkdir -p "$dir.partial"
    cp "$src/build/bin/llama-server" "$dir.partial/"
    rm -rf "$dir" "$src" && mv "$dir.partial" "$dir"
}

pid=""
server_stop() { if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }

server_start() {
    local name="$1" port
    shift
    port="$("$python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")"
    "$@" --host 127.0.0.1 --port "$port" >"$out/$name.log" 2>&1 &
    pid=$!
    url="http://127.0.0.1:$port"
    for _ in $(seq 600); do
        kill -0 "$pid" 2>/dev/null || { echo "$name exited while starting; see $out/$name.log" >&2; return 1; }
        "$python" -c "import httpx, sys; sys.exit(httpx.get(sys.argv[1], timeout=1).status_code != 200)" \
            "$url/health" 2>/dev/null && return 0
        sleep 0.5
    done
    echo "$name did not start; see $out/$name.log" >&2
    return 1
}
