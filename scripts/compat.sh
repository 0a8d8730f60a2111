#!/usr/bin/env bash
# Run the core tiers (config, the loop, checkpoints, strategies, resume: `pytest -m core`,
# the list is CORE_TIERS in tests/conftest.py) on one torch release.
#
#   scripts/compat.sh VERSION [pytest args]      e.g. scripts/compat.sh 2.14.1
#
# Builds .venv-compat-VERSION (once; reused while it holds that release) with
# `pip install torch==VERSION` and disttrain's test extra, resolved as a user's pip would:
# no constraints file. Prints one line at the end:
#   compat torch VERSION: N passed, N failed ... (core tiers, DATE)
# and exits with pytest's status. A VERSION below the floor in pyproject.toml does not
# resolve: lower the floor first to try it.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

VERSION="${1:?usage: scripts/compat.sh VERSION [pytest args]}"
shift
VENV=".venv-compat-$VERSION"
PY="$VENV/bin/python"
has_release() {
  "$PY" -c "import sys, torch, disttrain, pytest; sys.exit(torch.__version__.split('+')[0] != '$VERSION')" 2>/dev/null
}
if ! has_release; then
  python3 -m venv "$VENV"
  if ! "$PY" -m pip install -q --disable-pip-version-check "torch==$VERSION" -e ".[test]" || ! has_release; then
    echo "compat torch $VERSION: install failed (no result)"
    exit 2
  fi
fi

got=$("$PY" -c "import torch; print(torch.__version__)")
log="$VENV/core.log"
# Collect only the core tiers' files: a file outside them that fails to import on this
# release must not stop the run.
mapfile -t files < <("$PY" -c "import sys; sys.path.insert(0, 'tests'); from conftest import CORE_TIERS
print('\n'.join(dict.fromkeys(p.split('::')[0].replace('\\\\', '') for p in CORE_TIERS)))")
[[ ${#files[@]} -gt 0 ]] || { echo "compat torch $got: CORE_TIERS not read (no result)"; exit 2; }
"$PY" -m pytest -q -m core -p no:cacheprovider "${files[@]}" "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
summary=$(grep -E "[0-9]+ (passed|failed|error|errors|skipped|deselected)" "$log" | tail -n 1 | tr -d '=' | xargs)
echo "compat torch $got: ${summary:-no summary, exit $rc} (core tiers, $(date -u +%Y-%m-%d))"
exit "$rc"
