#!/usr/bin/env bash
# Set up .venv when missing, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One test at a time by default: on 2 cores the suite is CPU-bound, and three at a time
# (DISTTRAIN_TEST_WORKERS=3, pytest-xdist) measured only about 15 % faster while it
# doubles the load every timing bound of the multi-process tests sees.
exec .venv/bin/python -m pytest -q -n "${DISTTRAIN_TEST_WORKERS:-0}" --dist worksteal "$@"
