#!/usr/bin/env bash
# Install llama-cpp-python (the llama.cpp client the export tests run) into ./.venv, or into
# $PYTHON's environment when called with PYTHON=... .
# PyPI ships it as source only; building takes about 9 minutes on 2 cores, so the wheel is built
# once and cached in ~/.cache/hivetune/wheels (HIVETUNE_WHEELS), then reused in seconds.
# The default native build (-march=native) crashes with SIGSEGV in ggml's AMX matmul on Xeons
# with AMX at the first decode: build a portable AVX2 / FMA / F16C one instead.
# Beside the wheel: llama.cpp's own tokenizer test files from the same source package (vocab-only
# GGUFs of real models, test strings, and the ids their original tokenizers give), which the
# real-vocabulary tokenizer tests read (tests/model/test_gguf_real_vocab.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VERSION=0.3.36
WHEELS=${HIVETUNE_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/hivetune/wheels}
VOCABS="ggml-vocab-llama-spm ggml-vocab-llama-bpe ggml-vocab-phi-3 ggml-vocab-qwen2"
mkdir -p "$WHEELS"

vocab_files() {
  local dest="$WHEELS/llama-vocab-$VERSION" tmp name
  [ -f "$dest/ggml-vocab-qwen2.gguf.out" ] && return 0
  tmp=$(mktemp -d)
  # (called in an || list, where set -e does not apply: each step checks itself)
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp" || return 1
  tar -xzf "$tmp/llama_cpp_python-$VERSION.tar.gz" -C "$tmp" --wildcards "*/vendor/llama.cpp/models/ggml-vocab-*" \
    || return 1
  mkdir -p "$tmp/out"
  for name in $VOCABS; do
    cp "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp/models/$name".gguf* "$tmp/out/" || return 1
  done
  rm -rf "$dest" && mv "$tmp/out" "$dest" || return 1
  rm -rf "$tmp"
}

if ! "$PY" -c "import llama_cpp" 2>/dev/null; then
  wheel=$(ls "$WHEELS"/llama_cpp_python-$VERSION-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    echo "building llama-cpp-python $VERSION (once, about 9 minutes on 2 cores; cached in $WHEELS)" >&2
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
      "$PY" -m pip wheel -q --no-deps "llama-cpp-python==$VERSION" -w "$WHEELS"
    wheel=$(ls "$WHEELS"/llama_cpp_python-$VERSION-*.whl | head -n 1)
  fi
  "$PY" -m pip install -q "$wheel"
  "$PY" -c "import llama_cpp"
fi
vocab_files || echo "scripts/install_llama_cpp.sh: llama.cpp's tokenizer test files could not be fetched; the real-vocabulary tests will skip" >&2
