#!/usr/bin/env bash
# Set up .venv when missing, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Three tests at a time: the multi-process tests wait on launches, restarts and
# timeouts about as much as they compute, so two cores take a third job well.
# DISTTRAIN_TEST_WORKERS=0 runs them one after another.
exec .venv/bin/python -m pytest -q -n "${DISTTRAIN_TEST_WORKERS:-3}" --dist worksteal "$@"
