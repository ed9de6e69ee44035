#!/usr/bin/env bash
# Build llama.cpp's `llama-bench` from the vendored sources of the llama-cpp-python sdist, so that
# the comparison runs the same llama.cpp that the loader tests use as their reference.
#
# Usage: scripts/build_llama_bench.sh [BUILD_ROOT]      (default /work/compare-build)
# Env:   LLAMA_CPP_PYTHON_VERSION  sdist version (default: the installed llama-cpp-python, else
#                                  the newest on the index)
#        PIP                       pip to download with (default: python3 -m pip)
#        JOBS                      parallel compile jobs (default 2)
#        LLAMA_NO_AMX=1            compile without AMX (-mno-amx-*): on some AMX VMs ggml's AMX
#                                  matmuls die with SIGILL at a tile instruction once a prompt
#                                  is processed; the build goes to build-noamx/
# Prints the path of the llama-bench binary on its last line. Idempotent: an existing binary
# is reused; a finished download or extraction is not repeated.
set -euo pipefail

root="${1:-/work/compare-build}"
pip_cmd="${PIP:-python3 -m pip}"
jobs="${JOBS:-2}"
version="${LLAMA_CPP_PYTHON_VERSION:-}"
if [[ -z "$version" ]]; then
    version="$($pip_cmd show llama-cpp-python 2>/dev/null | sed -n 's/^Version: //p' || true)"
fi
mkdir -p "$root"
cd "$root"

spec="llama-cpp-python${version:+==$version}"
sdist="$(ls llama_cpp_python-${version:-*}.tar.gz 2>/dev/null | sort -V | tail -n1 || true)"
if [[ -z "$sdist" ]]; then
    $pip_cmd download --no-binary :all: --no-deps "$spec" -d "$root" >&2
    sdist="$(ls llama_cpp_python-${version:-*}.tar.gz | sort -V | tail -n1)"
fi
src="$root/${sdist%.tar.gz}"
if [[ ! -d "$src/vendor/llama.cpp" ]]; then
    tar xzf "$sdist" -C "$root"
fi

llama="$src/vendor/llama.cpp"
build="$llama/build"
flags=()
if [[ "${LLAMA_NO_AMX:-0}" == 1 ]]; then
    build="$llama/build-noamx"
    amx_off="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    flags=("-DCMAKE_C_FLAGS=$amx_off" "-DCMAKE_CXX_FLAGS=$amx_off")
fi
bin="$build/bin/llama-bench"
if [[ ! -x "$bin" ]]; then
    if ! command -v cmake >/dev/null; then
        echo "cmake not found: apt-get install cmake, or pip install cmake" >&2
        exit 1
    fi
    cmake -S "$llama" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF "${flags[@]}" >&2
    cmake --build "$build" --target llama-bench -j "$jobs" >&2
fi
echo "$bin"
