"""Per-device memory of one training step, per strategy, split into five parts.

Modelled as native torch does it (the parts disttrain composes), all in bytes per device:

* **params** - what each rank keeps between steps: the whole fp32 model for DDP and
  ZeRO-1; for FSDP2 (`fully_shard`) each parameter's dim-0 shard, padded to
  ceil(dim0 / world) rows because that is the storage behind `DTensor.to_local()`.
* **grads** - fp32, same layout as the parameters. DDP with `gradient_as_bucket_view=True`
  keeps them *in* its all-reduce buckets, so they are counted once; without it the
  buckets are a second copy (counted under buffers). FSDP2 keeps each group's sharded
  gradients as views into one padded reduce-scatter output.
* **optimizer state** - AdamW: exp_avg + exp_avg_sq (8 bytes/param, fp32 like the
  params) plus a 4-byte `step` tensor per parameter tensor; SGD with momentum: 4
  bytes/param; plain SGD: none. ZeRO-1 (`ZeroRedundancyOptimizer`) assigns whole
  parameters to ranks greedily, largest first, to the least-loaded rank: we replay that
  partition exactly when the shapes are known. FSDP2 optimizer state is `zeros_like` of
  the *unpadded* local shard, so the last ranks can hold fewer rows.
* **activations** - saved for backward by one micro-batch (accumulation does not add):
  per pre-norm block 9 h + 2 f (GELU MLP) or 9 h + 4 f (SwiGLU) values per token, in the
  compute dtype, plus the LM head's logits and fp32 log-softmax. Activation
  checkpointing keeps only each block's input and one block's worth during recompute.
* **buffers** - transient working memory: FSDP all-gathered parameters (full: the root
  plus the current and the prefetched block; grad_op: the whole model, kept from forward
  to backward), the unsharded gradients of one block and its fp32 reduce-scatter input;
  DDP's bucket copy when grads are not bucket views; the low-precision weight copies
  autocast saves for backward (DDP, ZeRO-1 under bf16/fp16); registered module buffers.

Mixed precision (bf16/fp16) is native torch's: fp32 parameters are the master weights,
autocast (DDP) or `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` (FSDP2)
computes in 16 bits, and gradients and optimizer state stay fp32: 16 bytes/param of
state with AdamW, as in P-FSDP-1 (fp16 adds only GradScaler's few scalars). fp8 is torchao's
Float8 training (parallel/fp8.py): bf16 as above, except that the linear layers it converts
(`ModelSpec.fp8_linears`) cast their fp32 weight to float8 themselves, so autocast makes no
16-bit copy of those weights (DDP, ZeRO-1: 2 bytes per converted weight element less), and
that float8 copies exist while a converted layer computes: its weight, input and output
gradient at 1 byte per element, one layer at a time (added to the buffers under every
strategy). Activations are saved as under bf16 (torchao keeps the bf16 input for
backward), and FSDP2 all-gathers bf16 parameters (no float8 all-gather). CPU offload
(FSDP2 `CPUOffloadPolicy`) moves sharded params, grads and optimizer state to host
memory, reported as `host` per device.

Not counted: the CUDA context and kernels (~0.5-1 GiB per process), allocator caching
and fragmentation (often 5-15%), NCCL's own buffers, attention score matrices (we
assume fused SDPA / flash attention, no s^2 term), dropout masks, temporary workspace
of matmuls and the optimizer's foreach intermediates. Headroom exists for these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from disttrain.errors import UserError
from disttrain.plan.model_size import ModelSpec

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
STRATEGIES = ("ddp", "zero1", "fsdp_grad_op", "fsdp_full")

# bytes of optimizer state per parameter element, and whether each tensor has a step counter
OPTIMIZERS: dict[str, tuple[int, bool]] = {"adamw": (8, True), "sgd": (0, False), "sgd-momentum": (4, False)}
STEP_BYTES = 4  # AdamW's `step`: a float32 scalar per parameter tensor
FP32 = 4
FP8 = 1


@dataclass(frozen=True)
class Variant:
    """One row of the plan: a strategy with or without CPU offload and activation checkpointing."""

    strategy: str
    cpu_offload: bool = False
    act_ckpt: bool = False

    @property
    def key(self) -> str:
        return self.strategy + ("+offload" if self.cpu_offload else "") + ("+ac" if self.act_ckpt else "")

    @property
    def label(self) -> str:
        base = {"ddp": "DDP", "zero1": "ZeRO-1", "fsdp_grad_op": "FSDP grad_op", "fsdp_full": "FSDP full"}[
            self.strategy
        ]
        return base + (" + offload" if self.cpu_offload else "") + (" + AC" if self.act_ckpt else "")


def all_variants() -> list[Variant]:
    """Every row, simplest first. CPU offload exists only for FSDP in native torch."""
    out = []
    for s in STRATEGIES:
        for offload in (False, True) if s.startswith("fsdp") else (False,):
            for ac in (False, True):
                out.append(Variant(s, offload, ac))
    return out


@dataclass(frozen=True)
class Workload:
    """What one optimizer step does on each device."""

    precision: str = "fp32"
    optimizer: str = "adamw"
    batch_per_device: int = 1
    """Sequences per device per micro-step."""
    seq_len: int = 1024
    accum_steps: int = 1
    gradient_as_bucket_view: bool = True

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise UserError(f"--precision {self.precision!r} is unknown; choose one of {', '.join(PRECISIONS)}.")
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"--optimizer {self.optimizer!r} is unknown; choose one of {', '.join(OPTIMIZERS)}.")
        for arg, v in (
            ("--batch", self.batch_per_device),
            ("--seq-len", self.seq_len),
            ("--accum-steps", self.accum_steps),
        ):
            if int(v) != v or v < 1:
                raise UserError(f"{arg} is {v}; it must be a whole number of at least 1.")

    @property
    def compute_bytes(self) -> int:
        """Bytes per activation and per all-gathered parameter element (fp8: bf16's)."""
        return FP32 if self.precision == "fp32" else 2


@dataclass
class Memory:
    """Bytes on the worst-loaded device, and each rank's persistent state for checking."""

    params: int
    grads: int
    optim: int
    activations: int
    buffers: int
    host: int = 0
    """Bytes in host memory per device (CPU offload)."""
    state_per_rank: list[dict[str, int]] = field(default_factory=list)
    """Per rank: params, grads, optim bytes wherever they live (device or host)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim + self.activations + self.buffers


def fmt_bytes(n: float) -> str:
    """Binary units, three significant digits: '1.5 GiB', '512 KiB', '0 B'."""
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}"
    return f"{int(n)} B"


# ---------------------------------------------------------------- layouts


def numels(spec: ModelSpec) -> list[int]:
    """Element count of each parameter tensor; one lump when only the total is known."""
    if spec.param_shapes is None:
        return [spec.n_params]
    return [math.prod(s) for s in spec.param_shapes]


def fsdp_layout(spec: ModelSpec, world: int) -> tuple[int, list[int]]:
    """(padded elements each rank stores, unpadded elements of each rank's local shard).

    `fully_shard` splits dim 0 with torch.chunk semantics: every rank's storage has
    ceil(d0/world) rows, the real rows of rank r are what remains after r full chunks.
    """
    shapes = spec.param_shapes or [(spec.n_params,)]
    padded = 0
    delta = [0] * (world + 1)  # difference array over ranks: O(shapes + world), not a product
    for shape in shapes:
        d0, rest = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
        chunk = -(-d0 // world)
        padded += chunk * rest
        full = d0 // chunk  # ranks 0..full-1 hold whole chunks, rank `full` the remainder
        delta[0] += chunk * rest
        delta[full] -= chunk * rest
        if full < world:
            delta[full] += (d0 - full * chunk) * rest
            delta[full + 1] -= (d0 - full * chunk) * rest
    local, running = [], 0
    for r in range(world):
        running += delta[r]
        local.append(running)
    return padded, local


def zero1_partition(sizes: list[int], world: int) -> list[tuple[int, int]]:
    """(elements, tensors) per rank as ZeroRedundancyOptimizer partitions them.

    Replays torch's `_partition_parameters`: a stable sort by size, largest first, each
    parameter to the rank with the smallest total so far (lowest rank on ties).
    """
    load, count = [0] * world, [0] * world
    for n in sorted(sizes, reverse=True):
        r = load.index(min(load))
        load[r] += n
        count[r] += 1
    return list(zip(load, count, strict=False))


def optim_bytes(work: Workload, elements: int, tensors: int) -> int:
    per_elem, has_step = OPTIMIZERS[work.optimizer]
    return per_elem * elements + (STEP_BYTES * tensors if has_step else 0)


# ---------------------------------------------------------------- activations


def activation_bytes(spec: ModelSpec, work: Workload, act_ckpt: bool, tp: int = 1) -> int:
    """Bytes saved for backward by one micro-batch (see the module docstring) on one rank
    of a tensor-parallel group of `tp`, which divides the values inside the split layers
    (`plan.tp`): 4 h + (5 h + 2 f) / tp per token and block."""
    tokens = work.batch_per_device * work.seq_len
    h, cb = spec.hidden, work.compute_bytes
    split = 5 * h + (4 if spec.gated_mlp else 2) * spec.ffn_hidden
    per_layer = tokens * (4 * h + -(-split // tp)) * cb
    if act_ckpt:
        body = spec.n_layer * tokens * h * cb + per_layer  # block inputs + one recompute
    else:
        body = spec.n_layer * per_layer
    # Final norm input and output, logits in the compute dtype, an fp32 copy for the loss
    # under autocast, and the fp32 log-softmax that cross-entropy saves.
    head = tokens * (2 * h * cb + spec.vocab_size * (cb + FP32 + (FP32 if cb < FP32 else 0)))
    return body + head


# ---------------------------------------------------------------- fp8


def fp8_weight_elements(spec: ModelSpec, work: Workload) -> int:
    """Elements of the weights fp8 converts: autocast makes no 16-bit copy of them (0
    unless the precision is fp8)."""
    return sum(o * i for o, i in spec.fp8_linears) if work.precision == "fp8" else 0


def fp8_scratch_bytes(spec: ModelSpec, work: Workload) -> int:
    """The float8 copies of the converted layer that computes now: weight, input and
    output gradient, 1 byte each, for the largest such layer (0 unless fp8)."""
    if work.precision != "fp8" or not spec.fp8_linears:
        return 0
    tokens = work.batch_per_device * work.seq_len
    return FP8 * max(o * i + tokens * (o + i) for o, i in spec.fp8_linears)


# ---------------------------------------------------------------- per strategy


def memory(spec: ModelSpec, work: Workload, world: int, variant: Variant, tp: int = 1) -> Memory:
    """Per-device bytes of `variant` training `spec` on `world` ranks; with `tp` > 1,
    `spec` is one TP rank's share (`plan.tp.local_spec`) and `world` the dp ranks."""
    sizes = numels(spec)
    P, cb = spec.n_params, work.compute_bytes
    buffers = spec.buffer_bytes + fp8_scratch_bytes(spec, work)
    if variant.strategy in ("ddp", "zero1"):
        if variant.strategy == "ddp":
            opt = [optim_bytes(work, P, len(sizes))] * world
        else:
            opt = [optim_bytes(work, n, k) for n, k in zero1_partition(sizes, world)]
        state = [{"params": FP32 * P, "grads": FP32 * P, "optim": o} for o in opt]
        if not work.gradient_as_bucket_view:
            buffers += FP32 * P  # the buckets are a second gradient copy
        if cb < FP32:  # autocast's 16-bit weight copies, saved for backward (fp8 casts its own)
            buffers += cb * (P - fp8_weight_elements(spec, work))
    else:
        padded, local = fsdp_layout(spec, world)
        state = [
            {"params": FP32 * padded, "grads": FP32 * padded, "optim": optim_bytes(work, n, len(sizes))} for n in local
        ]
        unit = spec.block_params or P
        if variant.strategy == "fsdp_full":
            gathered = cb * (spec.root_params + 2 * unit)  # root + current + prefetched block
        else:
            gathered = cb * P  # grad_op keeps every block unsharded from forward to backward
        buffers += gathered + cb * unit + FP32 * unit  # a block's grads + fp32 reduce-scatter input
    worst = max(state, key=lambda s: s["params"] + s["grads"] + s["optim"])
    acts = activation_bytes(spec, work, variant.act_ckpt, tp)
    if variant.cpu_offload:
        host = worst["params"] + worst["grads"] + worst["optim"]
        return Memory(0, 0, 0, acts, buffers, host=host, state_per_rank=state)
    return Memory(worst["params"], worst["grads"], worst["optim"], acts, buffers, state_per_rank=state)
