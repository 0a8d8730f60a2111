#!/usr/bin/env bash
# Install what the test suite needs, then run it:
# - the system packages the tests start themselves (apt-get, as root or through sudo):
#   etcd (Debian's etcd-server) for the elastic rendezvous tests, iproute2 for the
#   multi-node network-namespace tests, and, for the tests of `disttrain launch-file
#   slurm`, the shellcheck linter and a one-node Slurm (slurmctld, slurmd, slurm-client);
#   without apt-get the tests that need them skip;
# - .venv with the test extras (scripts/setup.sh --test), alongside apt;
# - pytest.
# The main job (scripts/train.sh) needs none of the system packages.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_pid=""
missing=()

install_system_packages() {
  command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  command -v shellcheck >/dev/null 2>&1 || missing+=(shellcheck)
  command -v slurmctld >/dev/null 2>&1 || missing+=(slurmctld slurmd slurm-client)
  [ ${#missing[@]} -gt 0 ] || return 0
  local sudo=""
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo="sudo"
  if ! command -v apt-get >/dev/null 2>&1 || { [ "$(id -u)" -ne 0 ] && [ -z "$sudo" ]; }; then
    echo "test: warning: ${missing[*]} not installed and apt-get unavailable; the tests that need them will skip." >&2
    return 0
  fi
  echo "test: installing ${missing[*]} (apt-get, alongside the Python packages)"
  # In the background: apt and pip wait on different downloads and disks.
  ( $sudo apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null ) &
  apt_pid=$!
}

install_system_packages
bash scripts/setup.sh --test
if [ -n "$apt_pid" ] && ! wait "$apt_pid"; then
  echo "test: apt-get install of ${missing[*]} failed (see its output above)." >&2
  exit 1
fi
# Python writes the bytecode of what it imports (src/, tests/, the workers' scripts) once
# and every later process reads it: the suite starts several hundred of them, and a
# machine that sets PYTHONDONTWRITEBYTECODE would make each compile those modules anew.
unset PYTHONDONTWRITEBYTECODE
# Three tests at a time by default (pytest-xdist): a serial run keeps about one of 2 cores
# busy (its multi-process tests wait on rendezvous, timeouts and restarts); two at a time
# still left a fifth of the 2 cores idle, three fill them. DISTTRAIN_TEST_WORKERS=N for
# another count, 0 for one at a time.
exec .venv/bin/python -m pytest -q -n "${DISTTRAIN_TEST_WORKERS:-3}" --dist worksteal "$@"
