#!/usr/bin/env bash
# Copies llama.cpp's HF -> GGUF converter (convert_hf_to_gguf.py, conversion/, gguf-py/) out of PyPI's
# llama-cpp-python sdist, the same sources build_llama_server.sh builds the server from.
# Usage: fetch_llama_converter.sh VERSION PREFIX   (output: $PREFIX/convert/)
set -euo pipefail
version="$1"; prefix="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==${version}" -d "$work"
tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"
mkdir -p "$prefix/convert"
cp -r "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$prefix/convert/"
test -f "$prefix/convert/convert_hf_to_gguf.py"
