#!/usr/bin/env bash
# Create .venv (when missing) and install disttrain with its test extras, plus the
# system packages the tests start themselves: etcd (Debian's etcd-server) for the
# elastic rendezvous tests, iproute2 for the multi-node network-namespace tests,
# and, for the tests of `disttrain launch-file slurm`, the shellcheck linter and a
# one-node Slurm (slurmctld, slurmd, slurm-client).
# torch is pinned by constraints.txt so pip takes the CPU build, never a CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
apt_pid=""

missing=()
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || missing+=(etcd-server)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v shellcheck >/dev/null 2>&1 || missing+=(shellcheck)
command -v slurmctld >/dev/null 2>&1 || missing+=(slurmctld slurmd slurm-client)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; }; then
    echo "setup: installing ${missing[*]} (apt-get, alongside the Python packages)"
    # In the background: apt and pip wait on different downloads and disks.
    ( $SUDO apt-get update -qq >/dev/null
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null ) &
    apt_pid=$!
  else
    echo "setup: warning: ${missing[*]} not installed and apt-get unavailable; the tests that need them will skip." >&2
  fi
fi

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import disttrain, pytest, xdist, kubernetes_validate, xxhash, tensorboard, mkdocstrings_handlers.python" 2>/dev/null; then
  python3 -m venv .venv
  # pip byte-compiles every installed module in one process; compileall with a process
  # per core does the same work in about half the wall time (some packages ship files
  # that do not compile, as under pip: its exit status is not ours).
  .venv/bin/python -m pip install -q --no-compile --disable-pip-version-check -c constraints.txt -e ".[test]"
  .venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages >/dev/null || true
fi
if [ -n "$apt_pid" ] && ! wait "$apt_pid"; then
  echo "setup: apt-get install of ${missing[*]} failed (see its output above)." >&2
  exit 1
fi
