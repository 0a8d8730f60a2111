"""Measurement harness shared, unchanged, by every workload script in this folder.

It is the part of each script that is not "user code": the model, the data, the
step clock and the JSON result. Keeping it in one module makes the scripts differ
only where a framework makes them differ, which is what the line count measures.

It never imports the `disttrain` package: the GPT is loaded from its source files
(`disttrain/builtin/gpt.py` imports only torch and the plain dataclass in
`disttrain/config/gpt_shape.py`), so the bare-PyTorch, Accelerate and Fabric scripts
do not pay for `import disttrain` and the disttrain one pays for it in full.

Environment (set by `bench.launch`):
    BENCH_T0        wall time (time.time()) just before the launcher started this process
    BENCH_STEPS     optimizer steps to time after the warmup (default 20)
    BENCH_WARMUP    optimizer steps before the clock starts (default 3)
    BENCH_OUT       folder for `rank{r}.json`
    BENCH_MODEL     JSON of GPTConfig fields (default: the tiny_gpt example's layers, context 64)
    BENCH_PROFILE   if set, cProfile the timed steps only and dump to BENCH_PROFILE.rank{r}
"""

from __future__ import annotations

import cProfile
import importlib.util
import json
import os
import resource
import sys
import sysconfig
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

MODEL = {"block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128, "dropout": 0.0}
BATCH_SIZE = 8  # per rank, per micro-step
ACCUM_STEPS = 2
CORPUS_BYTES = 1_000_000


def _load_source(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def _gpt_module():
    if "disttrain" in sys.modules:  # the disttrain workload: the real modules
        return importlib.import_module("disttrain.builtin.gpt")
    spec = importlib.util.find_spec("disttrain")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("disttrain is not importable: pip install -e . (or set PYTHONPATH=src)")
    root = Path(list(spec.submodule_search_locations)[0])
    # Registered under its real name, so gpt.py's one disttrain import finds it
    # without running the package.
    _load_source("disttrain.config.gpt_shape", root / "config" / "gpt_shape.py")
    return _load_source("bench_gpt", root / "builtin" / "gpt.py")


def model_config() -> dict:
    return {**MODEL, **json.loads(os.environ.get("BENCH_MODEL", "{}"))}


def make_model() -> torch.nn.Module:
    """The benchmark GPT (`disttrain.builtin.GPT`), built from the current RNG state."""
    gpt = _gpt_module()
    return gpt.GPT(gpt.GPTConfig(**model_config()))


def make_dataset() -> TensorDataset:
    """Windows of `block_size + 1` bytes of the standard library's source: (input, target)."""
    block = model_config()["block_size"]
    root = Path(sysconfig.get_paths()["stdlib"])
    buf = bytearray()
    for path in sorted(root.glob("*.py")):
        buf += path.read_bytes()
        if len(buf) >= CORPUS_BYTES:
            break
    tokens = torch.frombuffer(buf[:CORPUS_BYTES], dtype=torch.uint8).long()
    n = (len(tokens) - 1) // block
    windows = tokens[: n * block + 1]
    x = windows[:-1].view(n, block)
    y = windows[1:].view(n, block)
    return TensorDataset(x, y)


class Bench:
    """Clock for one process: `step()` after every optimizer step, `finish()` at the end."""

    def __init__(self) -> None:
        self.t0 = float(os.environ.get("BENCH_T0", time.time()))
        self.steps = int(os.environ.get("BENCH_STEPS", "20"))
        self.warmup = int(os.environ.get("BENCH_WARMUP", "3"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.times: list[float] = []
        self.first_step_s: float | None = None
        self.loss = float("nan")
        self.profile_path = os.environ.get("BENCH_PROFILE")
        self.profiler: cProfile.Profile | None = None

    def step(self, loss: torch.Tensor) -> bool:
        """Record one optimizer step; True once the warmup and the timed steps are done."""
        now = time.perf_counter()
        if self.first_step_s is None:
            self.first_step_s = time.time() - self.t0
        self.times.append(now)
        self.loss = float(loss.detach().float().mean())
        if self.profile_path and len(self.times) == self.warmup + 1:
            self.profiler = cProfile.Profile()
            self.profiler.enable()
        return len(self.times) >= self.warmup + self.steps + 1

    def finish(self) -> None:
        """Write `rank{r}.json`: per-step seconds, time to first step, peak RSS."""
        if self.profiler is not None:
            self.profiler.disable()
            self.profiler.dump_stats(f"{self.profile_path}.rank{self.rank}")
        timed = self.times[self.warmup :]
        step_s = [b - a for a, b in zip(timed, timed[1:], strict=False)]
        result = {
            "rank": self.rank,
            "world": self.world,
            "step_s": step_s,
            "first_step_s": self.first_step_s,
            "loss": self.loss,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "tokens_per_step": BATCH_SIZE * ACCUM_STEPS * model_config()["block_size"],
        }
        out = os.environ.get("BENCH_OUT")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            Path(out, f"rank{self.rank}.json").write_text(json.dumps(result))
