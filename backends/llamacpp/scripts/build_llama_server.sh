#!/usr/bin/env bash
# Builds llama.cpp's C++ llama-server from the llama.cpp sources vendored in PyPI's
# llama-cpp-python sdist (the only registry that carries them). Output: $PREFIX/bin/llama-server.
# Usage: build_llama_server.sh VERSION PREFIX
set -euo pipefail
version="$1"; prefix="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==${version}" -d "$work"
tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"
# Static, no TLS, no web UI download: the server must build with no network beyond the registry.
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
  -DGGML_NATIVE="${KVBENCH_GGML_NATIVE:-ON}" \
  -DCMAKE_C_FLAGS="${KVBENCH_GGML_CFLAGS:-}" -DCMAKE_CXX_FLAGS="${KVBENCH_GGML_CFLAGS:-}" >"$work/cmake.log" 2>&1 || { tail -40 "$work/cmake.log"; exit 1; }
cmake --build "$work/build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
mkdir -p "$prefix/bin"
install -m 755 "$work/build/bin/llama-server" "$prefix/bin/llama-server"
"$prefix/bin/llama-server" --version
# How it was built, for run.json and `kvbench backends` (the CPU features it may use differ per machine).
echo "GGML_NATIVE=${KVBENCH_GGML_NATIVE:-ON} ${KVBENCH_GGML_CFLAGS:-}" >"$prefix/BUILD_FLAGS"
