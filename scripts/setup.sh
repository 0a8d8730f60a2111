#!/usr/bin/env bash
# Create .venv (when missing) and install disttrain into it. No system package, no root.
#
#   bash scripts/setup.sh          the package and its dependencies: what the main job
#                                  (scripts/train.sh) and your own training need
#   bash scripts/setup.sh --test   also the test suite's Python packages (scripts/test.sh,
#                                  which installs the tests' system packages itself)
#
# torch is pinned by constraints.txt so pip takes the CPU build, never a CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."

spec="." probe="disttrain, rich, tensorboard, xxhash"
if [ "${1:-}" = "--test" ]; then
  spec=".[test]" probe="disttrain, pytest, xdist, kubernetes_validate, xxhash, tensorboard, mkdocstrings_handlers.python, torchao"
fi
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import $probe" 2>/dev/null; then
  python3 -m venv .venv
  # pip byte-compiles every installed module in one process; compileall with a process
  # per core does the same work in about half the wall time (some packages ship files
  # that do not compile, as under pip: its exit status is not ours). The test suite
  # (--test) skips it: scripts/test.sh lets Python write the bytecode of what it imports,
  # a fraction of the 2 GB installed, once.
  .venv/bin/python -m pip install -q --no-compile --disable-pip-version-check -c constraints.txt -e "$spec"
  if [ "${1:-}" != "--test" ]; then
    .venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages >/dev/null || true
  fi
fi
