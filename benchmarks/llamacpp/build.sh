#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-batched-bench from the source that the
# llama-cpp-python sdist on PyPI vendors: the reference a CPU user would run
# instead of wsinfer (Ollama, LM Studio and llama-server are all llama.cpp).
#
# A benchmark step, not part of CI: about 25 minutes on 2 cores. Idempotent: a
# finished build is reused. Usage:
#
#   benchmarks/llamacpp/build.sh [DEST]      # DEST defaults to .llamacpp/
#
# Needs cmake, a C++ compiler and PyPI (pip download). Prints the bin directory.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="$(realpath -m "${1:-$root/.llamacpp}")"
python="${PYTHON:-$root/.venv/bin/python}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
jobs="${JOBS:-$(nproc)}"
bin="$dest/build/bin"

if [[ -x "$bin/llama-server" && -x "$bin/llama-batched-bench" ]]; then
    echo "$bin"
    exit 0
fi

mkdir -p "$dest"
sdist="$dest/llama_cpp_python-$version.tar.gz"
if [[ ! -f "$sdist" ]]; then
    "$python" -m pip download --no-deps --no-binary :all: \
        "llama-cpp-python==$version" -d "$dest" >&2
fi
src="$dest/llama_cpp_python-$version/vendor/llama.cpp"
if [[ ! -d "$src" ]]; then
    tar -xzf "$sdist" -C "$dest"
fi

# No curl (the server reads a local file), no GPU back-ends; native CPU flags,
# as a llama.cpp user building for this machine gets by default.
build() {
    nice -n 19 cmake -S "$src" -B "$dest/build" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
        -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF "$@" >&2
    nice -n 19 cmake --build "$dest/build" -j "$jobs" \
        --target llama-server llama-batched-bench >&2
}

# A few tokens of the default model: does the build run on this CPU?
smoke() {
    local gguf
    gguf="$("$python" -c 'from wsinfer.engine.resolve import default_gguf_path; print(default_gguf_path())')"
    "$bin/llama-batched-bench" -m "$gguf" -t 1 -npp 8 -ntg 4 -npl 1 >/dev/null 2>&1
}

build
if ! smoke; then
    # Some virtual machines list AMX among the CPU's flags but fault on its tile
    # instructions (llama.cpp's int8 AMX kernels die with SIGILL there): build
    # without them, as a user of such a machine would have to.
    echo "llama.cpp: the native build fails on this CPU; building without AMX" >&2
    noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    build -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx"
    smoke
fi
echo "$bin"
