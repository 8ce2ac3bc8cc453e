#!/usr/bin/env bash
# Install everything, then run the default job: LoRA on SmolLM2-135M-Instruct, shipped data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hivetune train "$@"
