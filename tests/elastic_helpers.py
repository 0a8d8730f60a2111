"""Helpers for the elastic tests: start agents, watch a run's files, read its audit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
from conftest import ROOT, worker_env

from disttrain.elastic import final_timeline

# The main job shrunk to seconds: 768 chunks of 32 bytes, 96 steps of 8 per epoch.
TINY = ["--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--model.block_size=32",
        "--model.dropout=0.1", "--data.max_bytes=24577", "--data.drop_last=true",
        "--train.batch_size=4", "--train.eval_every=0", "--train.eval_batches=1",
        "--train.log_every=1", "--optim.lr=0.01", "--checkpoint.keep_last=2",
        "--elastic.record_samples=true"]


def trainer_cmd(out: Path, *extra: str, run_flags: tuple[str, ...] = ("--nproc", "2")) -> list[str]:
    return [sys.executable, "-m", "disttrain.cli", "run", *run_flags, "-m", "disttrain.train",
            "examples/tiny_gpt.toml", *TINY, f"--train.out_dir={out}", *extra]


def start(cmd: list[str], log: Path, **env: str) -> subprocess.Popen:
    """Start an agent in its own process group (so the test can kill it whole)."""
    return subprocess.Popen(cmd, cwd=ROOT, env=worker_env(**env), stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def run_trainer(out: Path, *extra: str, run_flags: tuple[str, ...], fault: str = "", timeout: float = 300) -> str:
    """`trainer_cmd` run to its end with `DISTTRAIN_FAULT=fault` (when given); its
    output (`out/log.txt`). Fails on a non-zero exit, and after `timeout` seconds."""
    log = out / "log.txt"
    proc = start(trainer_cmd(out, *extra, run_flags=run_flags), log, **({"DISTTRAIN_FAULT": fault} if fault else {}))
    try:
        assert proc.wait(timeout=timeout) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    return log.read_text()


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    children = [int(p) for p in out]
    return children + [d for c in children for d in descendants(c)]


def kill_node(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """A node failure: the agent and every process under it (torchrun starts workers
    in sessions of their own, so killing the agent's group alone leaves them running)."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate, timeout: float, what: str, logs: Sequence[Path] = ()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    tails = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in logs if p.exists())
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{tails}")


def audit_timeline(out: Path) -> dict[int, list[int]]:
    records = [json.loads(line) for f in sorted((out / "samples").glob("*.jsonl"))
               for line in f.read_text().splitlines() if line.strip()]
    return final_timeline(records)


def load_params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def last_loss_per_step(out: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(out)}


def assert_same_fast_run(ref: Path, out: Path, *, steps: int, samples_per_step: int, unlogged: int = 3) -> None:
    """An in-memory recovered run (`elastic.fast_recovery`) against the uninterrupted
    `ref`: the same final parameters bit for bit, the same loss at every logged step (a
    step whose log all-reduce lost the peer is committed but has no record: up to
    `unlogged` of them), and every sample of steps 1..`steps` exactly once."""
    a, b = load_params(ref / "model.pt"), load_params(out / "model.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs from the uninterrupted run"
    ref_loss, got = last_loss_per_step(ref), last_loss_per_step(out)
    assert len(got) >= steps - unlogged and all(got[s] == ref_loss[s] for s in got)
    timeline = audit_timeline(out)
    assert sorted(timeline) == list(range(1, steps + 1))
    counts = Counter(i for step in timeline.values() for i in step)
    assert len(counts) == steps * samples_per_step and set(counts.values()) == {1}
