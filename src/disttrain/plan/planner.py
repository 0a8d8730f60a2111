"""`estimate()`: every strategy's memory and communication, whether it fits, and a pick.

The recommendation rule, in order of preference:

1. Among the rows that fit with headroom (total <= device memory x (1 - headroom)),
   avoid CPU offload if at all possible (it is slow: P-FSDP-6), then take the least
   communication per step, then prefer no activation checkpointing (it recomputes the
   forward, ~30% more compute), then the simpler strategy (DDP, ZeRO-1, FSDP grad_op,
   FSDP full).
2. If nothing fits with headroom but something fits at all, the same order over those,
   flagged as tight.
3. If nothing fits, the row with the smallest peak, with how many devices would make
   FSDP full with activation checkpointing fit (when more devices help at all).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from disttrain.errors import UserError
from disttrain.plan.comm import Comm, communication
from disttrain.plan.lr import LRAdvice, advise
from disttrain.plan.memory import Memory, Variant, Workload, all_variants, fmt_bytes, memory
from disttrain.plan.model_size import ModelSpec, resolve_model
from disttrain.plan.tp import TP_VARIANT, tp_communication, tp_degrees, tp_memory, tp_traffic

FITS, TIGHT, NO_FIT = "fits", "tight", "does not fit"
MAX_WORLD = 65536
"""Most ranks a plan models: FSDP and ZeRO-1 layouts are per rank, so memory grows with it."""
_UNITS = {
    "": None,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}


def parse_bytes(text: str | int | float, arg: str = "--device-mem") -> int:
    """'80GiB' -> 85899345920. GB/TB are decimal, GiB (and bare G) binary; a unit is required."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
        if not m or m.group(2) not in _UNITS:
            raise UserError(f"{arg} {text!r} is not a size. Write it like 80GiB, 40GB or 24G.")
        unit = _UNITS[m.group(2)]
        if unit is None:
            raise UserError(f"{arg} {text!r} has no unit. Write it like 80GiB, 40GB or 24G.")
        value = float(m.group(1)) * unit
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"{arg} is {text!r}; it must be a positive size such as 80GiB.")
    return int(value)


@dataclass
class StrategyEstimate:
    """One row: bytes per device (worst rank), communication per step, fit."""

    key: str
    """Stable id, e.g. 'fsdp_full+offload+ac'."""
    label: str
    strategy: str
    cpu_offload: bool
    act_ckpt: bool
    params: int
    grads: int
    optim: int
    activations: int
    buffers: int
    total: int
    host: int
    """Host bytes per device (CPU offload)."""
    comm_bytes: int
    """Network bytes each device sends per optimizer step."""
    comm_parts: dict[str, int]
    host_transfer: int
    fit: str
    """'fits' (with headroom), 'tight' (fits, but inside the headroom) or 'does not fit'."""
    state_per_rank: list[dict[str, int]] = field(repr=False, default_factory=list)
    tp: int = 1
    """Tensor-parallel degree (the TP rows: FSDP full over world / tp ranks)."""

    @property
    def fits(self) -> bool:
        return self.fit != NO_FIT

    @property
    def state_bytes(self) -> int:
        """Params + grads + optimizer state of the worst rank, on device or host."""
        return max(sum(r.values()) for r in self.state_per_rank)


@dataclass
class Plan:
    """The whole answer. `recommended` is a `StrategyEstimate.key` (None only if no rows)."""

    model: ModelSpec
    workload: Workload
    devices_per_node: int
    nodes: int
    device_mem: int
    headroom: float
    strategies: list[StrategyEstimate]
    recommended: str | None
    reason: str
    lr: LRAdvice
    notes: list[str] = field(default_factory=list)
    tp_rows: list[StrategyEstimate] = field(default_factory=list)
    """One row per TP degree that divides the heads and a node's devices (`plan.tp`)."""
    tp_recommended: int | None = None
    """The smallest degree in `tp_rows` that fits; None when none does (or no rows)."""
    tp_reason: str = ""
    tp: int | None = None
    """The degree asked for (`--tp`, a TOML's [parallel] tp), checked against `tp_rows`."""

    @property
    def world(self) -> int:
        return self.devices_per_node * self.nodes

    def get_tp(self, tp: int) -> StrategyEstimate:
        """The TP row of degree `tp` (KeyError when that degree is not planned)."""
        for s in self.tp_rows:
            if s.tp == tp:
                return s
        raise KeyError(f"tp {tp}; degrees are {[s.tp for s in self.tp_rows]}")

    def get(self, key: str) -> StrategyEstimate:
        for s in self.strategies:
            if s.key == key:
                return s
        raise KeyError(f"{key!r}; rows are {[s.key for s in self.strategies]}")

    def to_dict(self) -> dict[str, Any]:
        """Plain data for `--format json`. Per-rank state is kept up to 64 ranks."""
        d = dataclasses.asdict(self)
        d["world"] = self.world
        d["model"].pop("param_shapes")
        d["model"]["exact_shapes"] = self.model.exact
        d["model"].pop("tp_dims")
        for row in d["strategies"] + d["tp_rows"]:
            if self.world > 64:
                row.pop("state_per_rank")
        return d


def _check_int(arg: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UserError(f"{arg} is {value!r}; it must be a whole number of at least {low}.")
    return value


def estimate(
    model: Any,
    *,
    devices: int = 1,
    nodes: int = 1,
    device_mem: str | int = "80GiB",
    precision: str = "fp32",
    optimizer: str = "adamw",
    batch_per_device: int = 1,
    seq_len: int | None = None,
    accum_steps: int = 1,
    headroom: float = 0.10,
    base_lr: float | None = None,
    base_batch: int = 256,
    steps: int | None = None,
    gradient_as_bucket_view: bool = True,
    tp: int | None = None,
) -> Plan:
    """Plan training of `model` on `nodes` x `devices` devices of `device_mem` each.

    `model`: a `ModelSpec`, a parameter count, a `GPTConfig`, a 'k=v,...' GPT spec, or a
    path to a disttrain TOML or a Hugging Face config.json. `seq_len` defaults to the
    model's context length. Every bad input raises `UserError` naming the argument.
    All byte counts in the result are per device; see `memory` and `comm` for the model.
    `tp_rows` hold each tensor-parallel degree (FSDP full over world / tp ranks, `plan.tp`)
    with `batch_per_device` as each TP group's batch; `tp` (the degree you mean to run)
    must be one of them, and the LR advice then counts world / tp data-parallel ranks.
    """
    _check_int("--devices", devices)
    _check_int("--nodes", nodes)
    if devices * nodes > MAX_WORLD:
        raise UserError(
            f"--devices x --nodes is {devices * nodes:,} ranks; the planner models up to "
            f"{MAX_WORLD:,} (per-rank layouts are computed rank by rank)."
        )
    mem = parse_bytes(device_mem)
    if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
        raise UserError(f"--headroom is {headroom!r}; use a fraction in [0, 1), e.g. 0.1.")
    spec = resolve_model(model)
    work = Workload(
        precision=precision,
        optimizer=optimizer,
        batch_per_device=batch_per_device,
        seq_len=seq_len if seq_len is not None else spec.max_seq,
        accum_steps=accum_steps,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )
    world = devices * nodes
    rows = [_row(spec, work, world, v, mem, headroom) for v in all_variants()]
    notes = list(spec.notes)
    if spec.exact and work.seq_len > spec.max_seq:  # a bare count has no real context
        notes.append(f"--seq-len {work.seq_len} exceeds the model's context {spec.max_seq}.")
    rec, reason = _recommend(rows, spec, work, world, devices, mem, headroom)
    tp_rows = [_tp_row(spec, work, world, t, mem, headroom) for t in _tp_choices(spec, work, world, devices)]
    if tp is not None:
        _check_tp(tp, tp_rows, spec, precision)
    tp_rec, tp_reason = _recommend_tp(tp_rows, mem, headroom, world, precision)
    lr = advise(batch_per_device, world // (tp or 1), accum_steps, base_lr, base_batch, steps)
    return Plan(
        model=spec,
        workload=work,
        devices_per_node=devices,
        nodes=nodes,
        device_mem=mem,
        headroom=headroom,
        strategies=rows,
        recommended=rec,
        reason=reason,
        lr=lr,
        notes=notes,
        tp_rows=tp_rows,
        tp_recommended=tp_rec,
        tp_reason=tp_reason,
        tp=tp,
    )


def _row(spec: ModelSpec, work: Workload, world: int, v: Variant, mem: int, headroom: float) -> StrategyEstimate:
    m, c = memory(spec, work, world, v), communication(spec, work, world, v)
    return _estimate_row(v.key, v.label, v, m, c, mem, headroom)


def _tp_row(spec: ModelSpec, work: Workload, world: int, tp: int, mem: int, headroom: float) -> StrategyEstimate:
    dp = world // tp
    m, c = tp_memory(spec, work, tp, dp), tp_communication(spec, work, tp, dp)
    return _estimate_row(f"tp{tp}", f"tp {tp} x dp {dp}", TP_VARIANT, m, c, mem, headroom, tp)


def _estimate_row(
    key: str, label: str, v: Variant, m: Memory, c: Comm, mem: int, headroom: float, tp: int = 1
) -> StrategyEstimate:
    fit = FITS if m.total <= mem * (1 - headroom) else TIGHT if m.total <= mem else NO_FIT
    return StrategyEstimate(
        key=key,
        label=label,
        strategy=v.strategy,
        cpu_offload=v.cpu_offload,
        act_ckpt=v.act_ckpt,
        params=m.params,
        grads=m.grads,
        optim=m.optim,
        activations=m.activations,
        buffers=m.buffers,
        total=m.total,
        host=m.host,
        comm_bytes=c.total,
        comm_parts=c.parts,
        host_transfer=c.host_transfer,
        fit=fit,
        state_per_rank=m.state_per_rank,
        tp=tp,
    )


def _tp_choices(spec: ModelSpec, work: Workload, world: int, per_node: int) -> list[int]:
    """The degrees to plan: none under fp8 (which tp refuses), else `plan.tp.tp_degrees`."""
    return [] if work.precision == "fp8" else tp_degrees(spec, world, per_node)


def _check_tp(tp: int, rows: list[StrategyEstimate], spec: ModelSpec, precision: str) -> None:
    """Refuse a degree the rows do not hold; 1 (no tensor parallelism) always passes."""
    if _check_int("--tp", tp) == 1:
        return
    if precision == "fp8":
        raise UserError(f"--tp {tp} with --precision fp8: fp8 does not compose with tensor parallelism; use bf16.")
    if not rows:
        raise UserError(
            f"--tp {tp}: {spec.name} has no tensor-parallel plan the planner knows (the built-in "
            f"GPT's, or a Hugging Face base_model_tp_plan); leave --tp out."
        )
    if tp not in [r.tp for r in rows]:
        raise UserError(
            f"--tp {tp} does not divide {spec.n_head} heads and the devices of a node into whole "
            f"heads per rank; use one of {[r.tp for r in rows]}."
        )


def _recommend_tp(
    rows: list[StrategyEstimate], mem: int, headroom: float, world: int, precision: str
) -> tuple[int | None, str]:
    """The smallest degree that fits with headroom, else the smallest that fits at all,
    else None and the closest row: TP's collectives sit on every layer's critical path."""
    if not rows:
        if precision == "fp8":
            return None, "fp8 does not compose with tensor parallelism"
        return None, "the model has no tensor-parallel plan (the built-in GPT's or a Hugging Face one)"
    for limit, how in ((mem * (1 - headroom), f"with {headroom:.0%} headroom"), (mem, "only inside the headroom")):
        ok = [r for r in rows if r.total <= limit]
        if ok:
            best = min(ok, key=lambda r: r.tp)
            why = f"the smallest degree that fits {how}: {fmt_bytes(best.total)} of {fmt_bytes(mem)}"
            if best.tp > 1:
                why += f"; {fmt_bytes(tp_traffic(best.comm_parts)[0])}/step of activation all-reduces inside each group"
            return best.tp, why
    best = min(rows, key=lambda r: r.total)
    return None, (
        f"no TP degree fits on {world} x {fmt_bytes(mem)}: tp {best.tp} comes closest at "
        f"{fmt_bytes(best.total)} per device; add activation checkpointing, cut the batch or add devices"
    )


def _recommend(
    rows: list[StrategyEstimate], spec: ModelSpec, work: Workload, world: int, per_node: int, mem: int, headroom: float
) -> tuple[str | None, str]:
    order = {r.key: i for i, r in enumerate(rows)}

    def preference(r: StrategyEstimate):
        return (r.cpu_offload, r.comm_bytes, r.act_ckpt, order[r.key])

    ddp = next(r for r in rows if r.key == "ddp")
    for wanted, how in (
        (FITS, f"fit with {headroom:.0%} headroom"),
        (TIGHT, f"fit only inside the {headroom:.0%} headroom"),
    ):
        ok = [r for r in rows if r.fit == wanted]
        if ok:
            best = min(ok, key=preference)
            why = (
                f"least communication ({fmt_bytes(best.comm_bytes)}/step per device) of the rows that "
                f"{how}: {fmt_bytes(best.total)} of {fmt_bytes(mem)}"
            )
            if best.key != "ddp" and ddp.fit != FITS:
                why += f"; DDP needs {fmt_bytes(ddp.total)}"
            if wanted == TIGHT:
                why += "; lower the batch or add devices for safety"
            return best.key, why
    best = min(rows, key=lambda r: (r.total, r.comm_bytes))
    why = (
        f"nothing fits on {world} x {fmt_bytes(mem)}; {best.label} comes closest at {fmt_bytes(best.total)} per device"
    )
    need = _devices_needed(spec, work, world, mem, headroom)
    if need:
        why += f"; FSDP full + AC fits on about {need} devices ({-(-need // per_node)} nodes)"
    else:
        why += "; more devices do not help enough: cut the batch or sequence length"
    return best.key, why


def _devices_needed(spec: ModelSpec, work: Workload, world: int, mem: int, headroom: float) -> int | None:
    """Smallest power-of-two multiple of `world` (up to 64x) where FSDP full + AC fits."""
    lean = dataclasses.replace(spec, param_shapes=None)  # even split is close enough here
    w = world * 2
    while w <= min(world * 64, MAX_WORLD):
        if memory(lean, work, w, Variant("fsdp_full", False, True)).total <= mem * (1 - headroom):
            return w
        w *= 2
    return None
