#!/usr/bin/env bash
# Set up .venv when missing, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two tests at a time by default (pytest-xdist): a serial run keeps about one of 2 cores
# busy (its multi-process tests wait on rendezvous, timeouts and restarts), two at a time
# fill the other. DISTTRAIN_TEST_WORKERS=N for another count, 0 for one at a time.
exec .venv/bin/python -m pytest -q -n "${DISTTRAIN_TEST_WORKERS:-2}" --dist worksteal "$@"
