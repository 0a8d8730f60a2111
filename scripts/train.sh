#!/usr/bin/env bash
# Set up .venv when missing (the Python package only: scripts/setup.sh, no apt-get, no
# root), then run the main job: a byte-level GPT trained with DDP on 2 CPU processes
# (gloo) over the Python standard library's own source.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/disttrain train examples/tiny_gpt.toml "$@"
