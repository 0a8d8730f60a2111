"""The set-up split: `bash scripts/train.sh` on a fresh clone installs
the Python package only, never an apt package; `bash scripts/test.sh` installs the test
suite's system packages.

Each script runs for real, by bash, in a copy of the repository's scripts, with the
commands it may call (apt-get, sudo, python3 and the venv it makes) shadowed on PATH by
stubs that record their calls: nothing is installed, nothing is downloaded. PATH holds
only the stubs and the few tools the scripts use, so etcd, ip, shellcheck and slurmctld
are missing, as on a fresh machine.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("bash", "dirname", "id", "mkdir", "cp", "touch", "cat")

RECORDER = """#!{bash}
echo "{name} $*" >> "$CALLS"
"""
PYTHON3 = """#!{bash}
echo "python3 $*" >> "$CALLS"
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin"
  cp "$STUBS/venv-python" "$3/bin/python"
  cp "$STUBS/venv-disttrain" "$3/bin/disttrain"
fi
"""
# The venv's python: an import probe fails until pip has "installed" something.
VENV_PYTHON = """#!{bash}
echo "venv-python $*" >> "$CALLS"
if [ "$1" = "-c" ]; then [ -e "$STUBS/installed" ]; exit $?; fi
if [ "$1 $2 $3" = "-m pip install" ]; then touch "$STUBS/installed"; fi
"""


def _script(path: Path, text: str) -> None:
    path.write_text(text.format(bash=shutil.which("bash"), name=path.name))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _fresh_clone(tmp_path: Path) -> tuple[Path, dict]:
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "scripts", repo / "scripts")
    stubs, tools = tmp_path / "stubs", tmp_path / "tools"
    stubs.mkdir()
    tools.mkdir()
    for tool in TOOLS:
        (tools / tool).symlink_to(shutil.which(tool))
    for name in ("apt-get", "sudo", "dpkg"):
        _script(stubs / name, RECORDER)
    _script(stubs / "python3", PYTHON3)
    _script(stubs / "venv-python", VENV_PYTHON)
    _script(stubs / "venv-disttrain", RECORDER.replace("{name}", "disttrain"))
    env = {"PATH": f"{stubs}{os.pathsep}{tools}", "CALLS": str(tmp_path / "calls"), "STUBS": str(stubs),
           "HOME": str(tmp_path)}
    return repo, env


def _run(repo: Path, env: dict, script: str) -> list[str]:
    proc = subprocess.run([shutil.which("bash"), f"scripts/{script}"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return Path(env["CALLS"]).read_text().splitlines()


def test_train_sh_on_a_fresh_clone_installs_the_package_and_no_apt_package(tmp_path):
    repo, env = _fresh_clone(tmp_path)
    calls = _run(repo, env, "train.sh")
    assert not [c for c in calls if c.startswith(("apt-get", "sudo", "dpkg"))], calls
    installs = [c for c in calls if " -m pip install " in c]
    assert len(installs) == 1 and installs[0].endswith("-e ."), installs
    assert calls[-1] == "disttrain train examples/tiny_gpt.toml"


def test_test_sh_installs_the_test_suites_system_packages_and_test_extras(tmp_path):
    repo, env = _fresh_clone(tmp_path)
    calls = _run(repo, env, "test.sh")
    apt = [c for c in calls if c.startswith("apt-get install")]
    assert len(apt) == 1, calls
    for package in ("etcd-server", "iproute2", "shellcheck", "slurmctld", "slurmd", "slurm-client"):
        assert package in apt[0].split()
    assert any(c.endswith('-e .[test]') for c in calls if " -m pip install " in c), calls
    assert calls[-1].startswith("venv-python -m pytest")
