#!/usr/bin/env bash
# Create .venv (when missing) and install disttrain with its test extras.
# torch is pinned by constraints.txt so pip takes the CPU build, never a CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import disttrain, pytest" 2>/dev/null; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test]"
fi
