#!/usr/bin/env bash
# Install everything, then run the test suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The report test renders the page in headless Chromium: install Debian's package when it is
# missing and we are root or have sudo (74 s with apt-get update, measured); else it skips.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then AS_ROOT=""; elif sudo -n true 2>/dev/null; then AS_ROOT="sudo -n"; else AS_ROOT="no"; fi
  if [ "$AS_ROOT" != "no" ]; then
    { $AS_ROOT apt-get update -qq && $AS_ROOT env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
      >/dev/null || echo "scripts/test.sh: could not install chromium; the browser test will skip" >&2
  fi
fi
# llama-cpp-python, the real client of the GGUF export test: built once (~9 min), then cached.
bash scripts/install_llama_cpp.sh \
  || echo "scripts/test.sh: llama-cpp-python could not be built; the llama.cpp client test will skip" >&2
exec .venv/bin/python -m pytest tests "$@"
