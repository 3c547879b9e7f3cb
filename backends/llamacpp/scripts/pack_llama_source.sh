#!/usr/bin/env bash
# Packs the llama.cpp sources that build llama-server (the ones build_llama_server.sh builds, vendored in
# PyPI's llama-cpp-python sdist) into one archive small enough for a GPU machine that takes at most 64 MiB
# of files and reaches no network: `python -m kvbench.selfcheck.gpu_check --llama-source ARCHIVE` builds its
# CUDA server there. Left out: the vocab GGUFs (models/), docs, tests, benches, examples, media, pocs
# (the sdist is 77 MB; this is about 8 MB). The converter (convert_hf_to_gguf.py, conversion/, gguf-py/) stays.
# Usage: pack_llama_source.sh VERSION OUT_DIR [SDIST]   (SDIST: a local llama_cpp_python-VERSION.tar.gz)
set -euo pipefail
version="$1"; out="$2"; sdist="${3:-}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if [ -z "$sdist" ]; then
  python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==${version}" -d "$work"
  sdist="$(echo "$work"/llama_cpp_python-*.tar.gz)"
fi
tar xzf "$sdist" -C "$work"
vendor="$(echo "$work"/llama_cpp_python-*/vendor)"
mkdir -p "$out"
archive="$out/llama.cpp-${version}-src.tar.xz"
tar -cJf "$archive" -C "$vendor" \
  --exclude='llama.cpp/models' --exclude='llama.cpp/docs' --exclude='llama.cpp/tests' \
  --exclude='llama.cpp/benches' --exclude='llama.cpp/examples' --exclude='llama.cpp/media' \
  --exclude='llama.cpp/pocs' --exclude='llama.cpp/.git*' llama.cpp
echo "$archive"
