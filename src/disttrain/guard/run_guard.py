"""Cross-rank consistency checks that turn silent divergence or hangs into errors.

Two checks that cost a collective each, run where a mistake would otherwise become a
hang or a silently wrong model (P-DEBUG-3):

- `check_consistency(model=..., config=..., **fields)` at start: every rank exchanges a
  fingerprint (config hash, torch and disttrain versions, model structure hash, and
  any named field such as accum_steps, dataset length or strategy). A mismatch raises
  `DistributedMismatchError` on every rank, naming the ranks and the fields.
- `check_replicas(model, step)` every K steps under DDP: one all-reduce of
  per-parameter checksums. Replicas that drifted apart raise an error naming the step
  and the first parameter that differs.

The small form, `assert_same_across_ranks`, lives in `disttrain.runtime.collectives`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from disttrain.errors import DistributedMismatchError
from disttrain.runtime import torch_compat
from disttrain.runtime.collectives import all_gather_json, comm_device

# ---------------------------------------------------------------- start-of-run fingerprint


def model_structure(model: nn.Module) -> list[str]:
    """`name:shape:dtype` of every parameter and buffer of the model, in order, as the
    user's unwrapped model has them: wrapper name parts removed and *logical*
    (unsharded) shapes under every strategy (DDP and ZeRO keep whole tensors, FSDP2's
    DTensors report the global shape, FSDP1's flat-shard views are mapped back to
    their original shapes). So ranks that hold different shards of one model agree,
    and a rank with a different model does not. No collective."""
    m = torch_compat.unwrap(model)
    flat = torch_compat.fsdp1_unsharded_shapes(model)  # the root FSDP1 unit sits above `m`
    items = [(n, t) for n, t in m.named_parameters()] + [(n, t) for n, t in m.named_buffers()]
    name = torch_compat.canonical_name
    return [f"{name(n)}:{flat.get(id(t), tuple(t.shape))}:{str(t.dtype).replace('torch.', '')}" for n, t in items]


def _config_items(config: Any) -> dict[str, str]:
    """A config (dataclass or dict) flattened to dotted keys with printable values."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    flat: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix.rstrip(".")] = json.dumps(node, default=str, sort_keys=True)

    walk("", config)
    return flat


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint(model: nn.Module | None = None, config: Any = None, **fields: Any) -> dict[str, str]:
    """This rank's fingerprint: field name -> short printable value (hashes for big ones)."""
    from disttrain.version import __version__

    fp = {"torch": torch.__version__, "disttrain": __version__}
    if config is not None:
        fp["config"] = _digest(_config_items(config))
    if model is not None:
        fp["model_structure"] = _digest(model_structure(model))
    for key, value in fields.items():
        fp[key] = json.dumps(value, default=str, sort_keys=True)
    return fp


def _first_difference(values: list[Any]) -> str:
    """For per-rank dicts or lists, which keys or entries differ, in words."""
    if all(isinstance(v, dict) for v in values):
        keys = sorted(set().union(*values))
        diff = [k for k in keys if len({json.dumps(v.get(k)) for v in values}) > 1]
        shown = "; ".join(
            f"{k}: " + ", ".join(f"rank {r}={v.get(k, '<missing>')}" for r, v in enumerate(values)) for k in diff[:5]
        )
        return f"differing keys ({len(diff)}): {shown}"
    for i in range(max(len(v) for v in values)):
        entries = [v[i] if i < len(v) else "<missing>" for v in values]
        if len(set(entries)) > 1:
            return f"first difference at entry {i}: " + ", ".join(f"rank {r}={e}" for r, e in enumerate(entries))
    return "no entry differs"


_DETAIL = {"config": dict[str, str] | None, "model_structure": list[str] | None}
"""The details behind a differing hash, as each rank sends them (None: not asked for)."""


def check_consistency(model: nn.Module | None = None, config: Any = None, **fields: Any) -> dict[str, str]:
    """Check that every rank runs the same job; return this rank's fingerprint.

    A collective: every rank must call it at the same point, with the same keyword
    names (for example `accum_steps=4, dataset_len=len(ds), strategy="ddp"`). Call it
    before `wrap()`: DDP's own check of parameter shapes gives a less precise error.
    On a mismatch it raises `DistributedMismatchError` on every rank (all ranks see
    the same gathered data), naming the fields that differ, each rank's value, the
    ranks that differ from the majority, and for the config and the model the first
    differing keys or parameters. A no-op check in a world of 1.
    """
    fp = fingerprint(model, config, **fields)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fp
    every: list[dict[str, str]] = all_gather_json(fp, shape=dict[str, str])
    keys = sorted(set().union(*every))
    bad = [k for k in keys if len({e.get(k) for e in every}) > 1]
    if not bad:
        return fp
    # Second, rare exchange: the details behind a differing hash.
    detail = {
        "config": _config_items(config) if "config" in bad and config is not None else None,
        "model_structure": model_structure(model) if "model_structure" in bad and model is not None else None,
    }
    details = all_gather_json(detail, shape=_DETAIL)
    odd: set[int] = set()
    lines = []
    for k in bad:
        values = [e.get(k, "<missing>") for e in every]
        common = Counter(values).most_common(1)[0][0]  # ties keep rank 0's value
        odd |= {r for r, v in enumerate(values) if v != common}
        line = f"  {k}: " + ", ".join(f"rank {r}={v}" for r, v in enumerate(values))
        if all(d.get(k) is not None for d in details):
            line += f"\n    {_first_difference([d[k] for d in details])}"
        lines.append(line)
    ranks = ", ".join(str(r) for r in sorted(odd))
    raise DistributedMismatchError(
        f"ranks disagree at start on {', '.join(bad)} (P-DEBUG-3); rank(s) {ranks} differ from "
        "the others:\n" + "\n".join(lines) + "\nEvery rank must run the same code, config, model "
        "and library versions; check per-rank overrides, environment variables and installs.",
        fingerprints=every,
    )


# ---------------------------------------------------------------- replica divergence


def _is_replicated(model: nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def _replicated(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    # A DTensor (a tensor-parallel or FSDP shard) differs across ranks by design.
    return [(n, p) for n, p in torch_compat.unwrap(model).named_parameters() if not hasattr(p, "device_mesh")]


@torch.no_grad()
def parameter_checksums(model: nn.Module) -> torch.Tensor:
    """Per replicated parameter (DTensor shards left out): (sum, sum of squares) in
    float64, shape (n_params, 2), on CPU."""
    sums = [torch.stack([p.sum(dtype=torch.float64), p.double().square().sum()]) for _, p in _replicated(model)]
    return torch.stack(sums).cpu() if sums else torch.zeros(0, 2, dtype=torch.float64)


def check_replicas(model: nn.Module, step: int) -> None:
    """Under DDP, check that every replica holds the same parameters (P-DDP-7).

    A collective: every rank calls it at the same step. Cost: one pass over the
    parameters and one all-reduce of 2 x 2 numbers per parameter, so call it every K
    steps. Replicas that differ (a rank-specific skipped step, an unsynchronised
    GradScaler, a non-deterministic op) raise `DistributedMismatchError` on every rank,
    naming the step, the first differing parameter, and the ranks that differ from
    rank 0. Models that are not DDP-replicated (FSDP shards, a world of 1) are skipped,
    and so are DTensor parameters (tensor-parallel shards differ across ranks by design).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1 or not _is_replicated(model):
        return
    # NaN on every rank is not divergence: compare it as an ordinary (huge) value.
    local = torch.nan_to_num(parameter_checksums(model), nan=1.2345e300)
    both = torch.cat([local, -local]).to(comm_device())  # one MAX all-reduce: max and -min
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    both = both.cpu()
    hi, lo = both[: len(local)], -both[len(local) :]
    differs = (hi != lo).any(dim=1)
    if not bool(differs.any()):
        return
    # Every rank saw the same reduced result, so every rank enters this second exchange.
    first = int(differs.nonzero()[0, 0])
    mine = local[first].contiguous().to(comm_device())
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    everyone = [v.cpu() for v in everyone]
    names = [torch_compat.canonical_name(n) for n, _ in _replicated(model)]
    ranks = [r for r, v in enumerate(everyone) if not torch.equal(v, everyone[0])]
    raise DistributedMismatchError(
        f"replicas diverged by step {step}: parameter {names[first]!r} (and "
        f"{int(differs.sum()) - 1} more) differs on rank(s) {ranks} from rank 0 "
        f"(sums: "
        + ", ".join(f"rank {r}={float(v[0]):.9g}" for r, v in enumerate(everyone))
        + "). Under DDP every rank must apply the same update: look for rank-specific "
        "optimizer steps or parameter edits, an fp16 GradScaler whose skip is not agreed "
        "by all ranks (P-DDP-7), or non-deterministic kernels."
    )


# ---------------------------------------------------------------- sizes of slow phases


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank


def tensor_nbytes(*objects: Any) -> int:
    """Bytes a checkpoint of these modules and optimizers may write, for the whole job:
    this rank's bytes of every parameter, buffer and optimizer-state tensor (its shard
    under FSDP), times the world size. An upper bound (a DDP replica counts once per
    rank), read without a collective."""
    total = 0
    for obj in objects:
        if isinstance(obj, nn.Module):
            tensors = [*obj.parameters(), *obj.buffers()]
        elif isinstance(obj, torch.optim.Optimizer):
            tensors = [v for state in obj.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        else:
            continue
        total += sum(_local(t).numel() * t.element_size() for t in tensors)
    return total * (dist.get_world_size() if dist.is_initialized() else 1)


def path_nbytes(path: str | Path | None) -> int:
    """Bytes of the files under `path` (0 when it is None or absent): what a resume
    reads at most (checksums of every file, then the load)."""
    if path is None or not Path(path).exists():
        return 0
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# ---------------------------------------------------------------- the run's guardrails


class RunGuard:
    """The default guardrails of one training run, as `disttrain train` uses them.

    Made by `start_guard`. `check_model(model, optimizer)` after wrap and optimizer,
    `first_batch(batch)` on every batch (it checks only the first), `step(n, model)`
    after each optimizer step (watchdog heartbeat; replica check every
    `divergence_every` steps), `phase(name)` around named parts, `slow_phase(name,
    nbytes)` around checkpoint saves and loads and evaluations, `close()` at the end.
    With `enabled=False` every method is a no-op.
    """

    def __init__(self, cfg, watchdog=None):
        self.cfg, self.watchdog = cfg, watchdog
        self._batch_checked = not cfg.enabled

    def check_model(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Same model structure on every rank; the stepped model is wrapped (collective)."""
        if not self.cfg.enabled:
            return
        from disttrain.guard.sanity import check_wrapped

        check_consistency(model=model)
        check_wrapped(model, optimizer, strict=self.cfg.strict)

    def first_batch(self, batch: Any, tp: int = 1) -> None:
        """On the first call only: warn when every data-parallel rank drew the same batch
        (the `tp` ranks of a tensor-parallel group must; a collective)."""
        if self._batch_checked:
            return
        self._batch_checked = True
        from disttrain.guard.sanity import check_first_batch

        check_first_batch(batch, strict=self.cfg.strict, tp=tp)

    def step(self, n: int, model: nn.Module) -> None:
        """After optimizer step `n`: heartbeat, and every K steps the replica checksum."""
        if self.watchdog is not None:
            self.watchdog.step(n)
        k = self.cfg.divergence_every
        if self.cfg.enabled and k and n % k == 0:
            check_replicas(model, n)

    def phase(self, name: str, slow: bool = False):
        """`with guard.phase("forward"):`; every rank must enter the same phases.
        `slow=True` is `slow_phase(name)` without bytes."""
        import contextlib

        return self.watchdog.phase(name, slow) if self.watchdog is not None else contextlib.nullcontext()

    def slow_phase(self, name: str, nbytes: int = 0):
        """`with guard.slow_phase("checkpoint.save", nbytes=tensor_nbytes(model, opt)):`
        around work that is not a training step (a checkpoint save or load, an
        evaluation). It is a hang only past a floor plus `nbytes` at a conservative
        disk speed (`Watchdog.slow_bound`), and its time does not count toward the
        step's bound. Every rank must enter it at the same point."""
        import contextlib

        if self.watchdog is None:
            return contextlib.nullcontext()
        return self.watchdog.slow_phase(name, nbytes)

    def close(self) -> None:
        """Stop the watchdog (call before work that is not a training step). Idempotent."""
        if self.watchdog is not None:
            self.watchdog.stop()


def start_guard(cfg=None, *, config: Any = None, timeout_s: float | None = None, **fields: Any) -> RunGuard:
    """Run the start-of-run checks and start the hang watchdog; return a `RunGuard`.

    `cfg` is a `GuardConfig` (defaults when None). A collective: every rank calls it
    once after `init()` and before `wrap()`, with the same `fields` (for example
    accum_steps, dataset_len, strategy). Raises `DistributedMismatchError` (ranks
    differ) or `NotDistributedError` (fewer processes than asked for) on every rank;
    warns for oversubscribed CPU threads. The watchdog's cap stays below the
    collective timeout `timeout_s`, so the guard reports before torch times out.
    """
    import atexit

    from disttrain.config import GuardConfig
    from disttrain.guard.sanity import check_threads, check_world_size
    from disttrain.guard.script_watchdog import hand_over

    cfg = cfg or GuardConfig()
    if not cfg.enabled:
        hand_over(None)
        return RunGuard(cfg)
    check_world_size(strict=cfg.strict)
    check_threads(strict=cfg.strict)
    check_consistency(config=config, **fields)
    watchdog = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        from disttrain.guard.private_dir import UnsafeGuardDir
        from disttrain.guard.watchdog import Watchdog, default_dir, job_key

        cap = min(cfg.hang_cap_s, 0.9 * timeout_s) if timeout_s else cfg.hang_cap_s
        # A shared guard.dir gets one subdirectory per job attempt, so runs never mix.
        side = Path(cfg.dir) / job_key() if cfg.dir else None
        try:
            successor = side or default_dir()
        except UnsafeGuardDir:
            successor = None  # Job's watchdog says why and stays off
        hand_over(successor)  # this watchdog knows the steps
        watchdog = Watchdog(
            dir=side,
            hang_factor=cfg.hang_factor,
            hang_min_s=min(cfg.hang_min_s, cap),
            hang_cap_s=cap,
            tick_s=cfg.tick_s,
        ).start()
        atexit.register(watchdog.stop)
    return RunGuard(cfg, watchdog)
