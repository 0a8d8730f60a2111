"""How many of disttrain's files stand between a command and the optimizer step.

Starts a real, tiny `disttrain train` run (examples/tiny_gpt.toml, 2 CPU ranks, 2 steps)
with a `sitecustomize` on the path of every process it starts, which records:

- in a worker (a process torchrun started: LOCAL_RANK is set), at the first
  `Optimizer.step` (torch's public global step pre-hook), the stack;
- in the launcher, the stack at each subprocess creation (torchrun's agent starting a
  worker is one of them).

Each chain is the distinct disttrain source files on that stack, outermost first (torch
and the standard library left out). The worker's chain starts at the module torchrun
is asked to start, `train/__main__.py` (a warm worker is forked from the launcher, whose
frames come first on its stack and are not counted); the launcher's at cli.py.

    python -m bench.call_chain          # prints both chains
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "disttrain"
WORKER_ENTRY = "train/__main__.py"
"""The module torchrun starts on each rank of `disttrain train` (`-m disttrain.train`)."""

# Written as the sitecustomize of every process of the run: records stacks as JSON lines.
_RECORDER = r"""
import json, os, traceback

_OUT = os.environ["DT_CALL_CHAIN_OUT"]


def _write(role, stack):
    files = [f.filename for f in stack]
    with open(os.path.join(_OUT, f"{role}-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(files) + "\n")


import subprocess
import torch.optim.optimizer as _opt


# Registered in every process: warm workers fork from a pool started before torchrun
# sets a worker's LOCAL_RANK.
def _first_step(optimizer, args, kwargs):
    if os.environ.get("LOCAL_RANK") is not None and not getattr(_first_step, "done", False):
        _first_step.done = True
        _write("worker", traceback.extract_stack()[:-1])


_opt.register_optimizer_step_pre_hook(_first_step)
_init = subprocess.Popen.__init__


def _recording_init(self, *args, **kwargs):
    if os.environ.get("LOCAL_RANK") is None:
        _write("launcher", traceback.extract_stack()[:-1])
    _init(self, *args, **kwargs)


subprocess.Popen.__init__ = _recording_init
"""


def chain(files: list[str], package: Path = PACKAGE) -> list[str]:
    """The distinct files under `package` in `files` (a stack, outermost first), as paths
    relative to it, in the order first seen."""
    out: list[str] = []
    for name in files:
        path = Path(name).resolve()
        if package in path.parents:
            rel = path.relative_to(package).as_posix()
            if rel not in out:
                out.append(rel)
    return out


def measure(timeout: float = 300) -> dict[str, list[str]]:
    """Run the tiny training and return {"worker": chain, "launcher": chain}: the
    worker's at its first optimizer step, the launcher's at the subprocess creation
    by which torchrun's agent started a worker. Raises
    `RuntimeError` with the run's output when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        hook, out = Path(tmp) / "hook", Path(tmp) / "out"
        hook.mkdir()
        out.mkdir()
        (hook / "sitecustomize.py").write_text(_RECORDER)
        env = dict(
            os.environ,
            DT_CALL_CHAIN_OUT=str(out),
            PYTHONPATH=os.pathsep.join([str(hook), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        )
        small = [
            "--model.n_layer=1",
            "--model.n_embd=32",
            "--model.n_head=2",
            "--model.block_size=32",
            "--data.max_bytes=100000",
            "--train.steps=2",
            "--train.batch_size=4",
            "--train.eval_every=0",
            "--train.eval_batches=1",
            "--parallel.nproc=2",
            f"--train.out_dir={Path(tmp) / 'run'}",
        ]
        proc = subprocess.run(
            [sys.executable, "-m", "disttrain.cli", "train", "examples/tiny_gpt.toml", *small],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the tiny run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        stacks: dict[str, list[list[str]]] = {"worker": [], "launcher": []}
        for path in out.iterdir():
            role = path.name.split("-")[0]
            stacks[role] += [json.loads(line) for line in path.read_text().splitlines()]
    workers = [chain(s) for s in stacks["worker"]]
    # torchrun's agent starting a worker process (torch's subprocess handler)
    launcher = [chain(s) for s in stacks["launcher"] if any("subprocess_handler" in f for f in s)]
    # A warm worker is forked from the launcher: its stack begins with the launcher's
    # frames. Its chain begins at its entry module, the one torchrun is asked to start.
    workers = [w[w.index(WORKER_ENTRY) :] if WORKER_ENTRY in w else w for w in workers]
    return {"worker": max(workers, key=len) if workers else [], "launcher": max(launcher, key=len) if launcher else []}


def main() -> None:
    chains = measure()
    for role, files in chains.items():
        print(f"{role}: {len(files)} files: {' -> '.join(files)}")


if __name__ == "__main__":
    main()
