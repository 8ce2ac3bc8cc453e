#!/usr/bin/env bash
# Install llama-cpp-python (the llama.cpp client the export tests run) into ./.venv, or into
# $PYTHON's environment when called with PYTHON=... .
# PyPI ships it as source only; building takes about 9 minutes on 2 cores, so the wheel is built
# once and cached in ~/.cache/hivetune/wheels (HIVETUNE_WHEELS), then reused in seconds.
# The default native build (-march=native) crashes with SIGSEGV in ggml's AMX matmul on Xeons
# with AMX at the first decode: build a portable AVX2 / FMA / F16C one instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VERSION=0.3.36
if "$PY" -c "import llama_cpp" 2>/dev/null; then
  exit 0
fi
WHEELS=${HIVETUNE_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/hivetune/wheels}
mkdir -p "$WHEELS"
wheel=$(ls "$WHEELS"/llama_cpp_python-$VERSION-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
  echo "building llama-cpp-python $VERSION (once, about 9 minutes on 2 cores; cached in $WHEELS)" >&2
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
    "$PY" -m pip wheel -q --no-deps "llama-cpp-python==$VERSION" -w "$WHEELS"
  wheel=$(ls "$WHEELS"/llama_cpp_python-$VERSION-*.whl | head -n 1)
fi
"$PY" -m pip install -q "$wheel"
"$PY" -c "import llama_cpp"
