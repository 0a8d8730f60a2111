"""Shared helpers: launch real multi-process jobs on torchrun (gloo) with a timeout."""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


SESSION_ENV = frozenset(os.environ)
"""The variables the test session started with."""
JOB_SCOPED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What a distributed job sets in its processes: an in-process test of the runtime sets
them in this process, and a job a later test starts must not inherit them (a test
passes them in `extra` when it means to)."""


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a process a test starts: this one's, less the `JOB_SCOPED`
    variables an earlier in-process test left, plus the suite's settings and `extra`."""
    env = {k: v for k, v in os.environ.items() if k in SESSION_ENV or k not in JOB_SCOPED}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(WORKERS)])
    return env


def run_disttrain(args: list[str], timeout: float = 180, cwd: Path | None = None,
                  env: dict | None = None) -> subprocess.CompletedProcess:
    """`disttrain ARGS` in a subprocess; a hang fails the test after `timeout` seconds."""
    return subprocess.run([sys.executable, "-m", "disttrain.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd or ROOT, env=env or worker_env())


def run_cmd(nproc: int, *script_and_args: str) -> list[str]:
    """The command line of `disttrain run --nproc NPROC SCRIPT ARGS` (torchrun with the
    user's defaults: standalone rendezvous, warm workers)."""
    return [sys.executable, "-m", "disttrain.cli", "run", "--nproc", str(nproc), *script_and_args]


def run_checked(script: Path, *args: str, check: tuple[str, ...] = ("--check",),
                timeout: float = 120) -> subprocess.CompletedProcess:
    """`disttrain run --nproc 2 CHECK... SCRIPT ARGS` (the `--check` flags by default) in a
    subprocess; a hang fails the test after `timeout` seconds."""
    return subprocess.run(run_cmd(2, *check, str(script), *args), capture_output=True, text=True,
                          timeout=timeout, env=worker_env())


def script_line(script: Path, text: str) -> str:
    """'NAME:N' of `script`'s first line holding `text`: how a message names a user's line."""
    lines = script.read_text().splitlines()
    return f"{script.name}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def launch_worker(script: str, nproc: int, out_dir: Path, *args: str, timeout: float = 240) -> list[dict]:
    """Run tests/workers/SCRIPT on `nproc` gloo ranks under `disttrain run` (torchrun,
    warm workers) and return each rank's JSON result (`out_dir/rank{r}.json`). Fails
    with the job's output on error."""
    cmd = run_cmd(nproc, str(WORKERS / script), str(out_dir), *args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=worker_env())
    if proc.returncode != 0:
        pytest.fail(f"{script} at nproc={nproc} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-6000:]}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def built_once(tmp_path_factory, key: str, build):
    """`build(directory)` run once per test session and its (pickled) value shared by every
    pytest-xdist worker. A module fixture is otherwise built again by each worker that runs
    one of the module's tests, and again whenever work stealing interleaves another module
    (pytest tears module fixtures down between modules): the expensive launches behind
    the fixtures ran up to three times. Tests read or copy what is in `directory`; a
    failed or skipped build fails or skips every test that asks for it, without building
    again."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # pytest-xdist: the workers' base directories share this parent
    directory, value_file = base / f"once-{key}", base / f"once-{key}.pickle"
    with open(base / f"once-{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits for the first build
        if not value_file.exists():
            directory.mkdir(exist_ok=True)
            try:
                outcome = ("ok", build(directory))
            except (Exception, pytest.fail.Exception, pytest.skip.Exception) as exc:
                kind = "skip" if isinstance(exc, pytest.skip.Exception) else "fail"
                value_file.write_bytes(pickle.dumps((kind, f"{type(exc).__name__}: {exc}")))
                raise
            value_file.write_bytes(pickle.dumps(outcome))
            return outcome[1]
    kind, value = pickle.loads(value_file.read_bytes())
    if kind == "skip":
        pytest.skip(value)
    if kind == "fail":
        pytest.fail(f"the shared fixture {key!r} failed when built for an earlier test: {value}", pytrace=False)
    return value


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The root of one committed checkpoint (step 1) of the tiny GPT of
    tests/workers/ckpt_common.py, made once per session (`built_once`). Tests that
    change it work on a copy (`checkpoint_copy`)."""

    def make(directory: Path) -> Path:
        if str(WORKERS) not in sys.path:
            sys.path.insert(0, str(WORKERS))
        # by name: tests/workers is on the path of a test run, not of the type checker's
        importlib.import_module("ckpt_common").saved_once(directory / "ckpt")
        return directory / "ckpt"

    return built_once(tmp_path_factory, "saved-checkpoint", make)


def checkpoint_copy(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of `tiny_checkpoint` under `tmp_path`: (its root, its step folder)."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    return root, root / "step-00000001"


CORE_TIERS = (
    # The core tiers: config, the loop (dt.Job), checkpoints, strategies and resume, in a
    # few minutes on 2 cores. `pytest -m core` runs them; scripts/compat.sh runs them on
    # another torch release. Each entry is a regular expression matched at the start of
    # a test's node id.
    r"tests/unit/test_config\.py::",
    r"tests/unit/test_strategies_config\.py::",
    r"tests/launch/test_strategies\.py::.*\[2\b",  # every strategy at a world of 2 (one launch)
    r"tests/faults/test_job\.py::test_(kill_9_resumes|complete_job|misuse|elastic_sampler)",
    r"tests/faults/test_checkpoint\.py::",
    r"tests/faults/test_checkpoint_writer\.py::",
    r"tests/launch/test_resume_config\.py::test_(complete_run|changed_|apply_matches|classes_of_keys)",
)


TIERS = ("unit", "launch", "faults", "policy")
"""A test's tier is the folder it lives in, chosen for what it does: `tests/unit` runs
in-process (a minute or two), `tests/launch` starts processes (torchrun, `disttrain
run`, gloo groups, forks), `tests/faults` kills, stops or breaks them on purpose, and
`tests/policy` holds the repository's own rules (lint, types, layers, the docs build,
our own code). `pytest tests/unit` or `pytest -m unit` runs one tier."""
TESTS = Path(__file__).resolve().parent


def tier_of(path: Path) -> str:
    """The tier of the test module at `path`: the folder under tests/ it lives in."""
    parts = Path(path).resolve().relative_to(TESTS).parts
    if len(parts) < 2 or parts[0] not in TIERS:
        raise ValueError(f"{path}: a test module lives in one of the tier folders {', '.join(TIERS)}")
    return parts[0]


def pytest_collection_modifyitems(config, items):
    core = re.compile("|".join(f"(?:{p})" for p in CORE_TIERS))
    for item in items:
        if core.match(item.nodeid):
            item.add_marker(pytest.mark.core)
        item.add_marker(getattr(pytest.mark, tier_of(Path(item.fspath))))
