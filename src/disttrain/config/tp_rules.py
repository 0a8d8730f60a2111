"""What tensor parallelism (`[parallel] tp = N`) accepts, as plain arithmetic.

One place for the rules that the launcher's validation and `dt.wrap` share:

- the degree divides the world: the ranks form a (data-parallel x tp) grid whose tp
  dimension is innermost, so the ranks of one TP group are consecutive (one node's
  devices on a real cluster);
- the strategy is `fsdp` (any sharding mode: the data-parallel dimension is sharded,
  replicated or both) or `ddp` with no data-parallel replicas (tp = world); the other
  strategies' wrappers cannot hold tensor-parallel (DTensor) parameters;
- the built-in GPT's heads and MLP width divide by the degree, so each rank runs whole
  heads;
- sequence and loss parallelism need a degree above 1, and split the built-in GPT's
  sequence and vocabulary into equal slices.

Each refusal is one `ConfigError` naming the sizes that would work. No torch here.
"""

from __future__ import annotations

from disttrain.errors import ConfigError

TP_STRATEGIES = ("fsdp", "ddp")
"""The strategies a tensor-parallel model composes with."""
TP_STYLES = ("colwise", "rowwise", "sequence")
"""The words of a plan (`parallel.tp_plan`): how a module is split (parallel/tensor_parallel.py)."""


def divisors(n: int) -> list[int]:
    """Every positive divisor of `n`, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tp(strategy: str, tp: int, precision: str, world_size: int) -> None:
    """Refuse a tensor-parallel degree the world or the strategy cannot serve.

    Raises `ConfigError` naming the degrees that divide the world, or the strategy
    to use instead. `tp = 1` (no tensor parallelism) is always accepted.
    """
    if tp < 1:
        raise ConfigError(f"parallel.tp is {tp}; use 1 (no tensor parallelism) or a degree that divides the world.")
    if tp == 1:
        return
    if world_size % tp:
        raise ConfigError(
            f"parallel.tp is {tp}, which does not divide the world of {world_size} ranks; "
            f"use one of {divisors(world_size)}."
        )
    if strategy not in TP_STRATEGIES:
        raise ConfigError(
            f"parallel.tp = {tp} composes with parallel.strategy 'fsdp' (any sharding) or 'ddp', "
            f"not {strategy!r}; use --parallel.strategy=fsdp."
        )
    if strategy == "ddp" and world_size > tp:
        raise ConfigError(
            f"parallel.tp = {tp} with strategy 'ddp' leaves {world_size // tp} data-parallel replicas, "
            f"which DDP cannot hold (its parameters are split tensors); use --parallel.strategy=fsdp "
            f"(--parallel.sharding=none replicates like DDP), or --parallel.tp={world_size}."
        )
    if precision == "fp8":
        raise ConfigError(f"train.precision 'fp8' does not compose with parallel.tp = {tp}; use bf16.")


def check_tp_options(tp: int, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Refuse sequence or loss parallelism without a TP group to split over.

    Raises `ConfigError` naming the option and the degree it needs.
    """
    for name, on in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)):
        if on and tp <= 1:
            raise ConfigError(
                f"parallel.{name} = true splits over the tensor-parallel group, but parallel.tp is {tp}; "
                f"set parallel.tp to 2 or more, or parallel.{name} = false."
            )


def check_gpt_tp_options(
    tp: int, *, block_size: int, vocab_size: int, sequence_parallel: bool, loss_parallel: bool
) -> None:
    """Refuse a built-in GPT whose sequence (sequence parallel) or vocabulary (loss
    parallel) does not split into `tp` equal slices. Raises `ConfigError` naming the
    key to change."""
    if sequence_parallel and block_size % tp:
        raise ConfigError(
            f"parallel.sequence_parallel splits the sequence of {block_size} tokens (data.block_size, else "
            f"model.block_size) over parallel.tp = {tp}; use a block size that divides by {tp}."
        )
    if loss_parallel and vocab_size % tp:
        raise ConfigError(
            f"parallel.loss_parallel splits the built-in GPT's {vocab_size} tokens (model.vocab_size) over "
            f"parallel.tp = {tp}; use a vocabulary size that divides by {tp}."
        )


def check_tp_plan(plan: dict[str, str]) -> None:
    """Refuse a `parallel.tp_plan` entry whose name is not a dotted module name (parts
    that are names, numbers or `*`) or whose style is not one of `TP_STYLES`. Raises
    `ConfigError` naming the entry. Whether a name matches a module is checked when the
    model is split (`parallel.tensor_parallel.resolve_plan`)."""
    styles = ", ".join(map(repr, TP_STYLES))
    for pattern, style in plan.items():
        if not all(part == "*" or part.isidentifier() or part.isdigit() for part in pattern.split(".")):
            raise ConfigError(
                f"parallel.tp_plan names {pattern!r}, which is not a module name; write dotted names with "
                f"'*' for one part, like 'blocks.*.attn.q'."
            )
        if style not in TP_STYLES:
            raise ConfigError(
                f"parallel.tp_plan[{pattern!r}] is {style!r}; use one of {styles} (torch ParallelStyle "
                f"objects only through dt.wrap(..., tp_plan=...) or dt.Job(tp_plan=...) in Python)."
            )


def check_gpt_tp(n_head: int, n_embd: int, tp: int, world_size: int) -> None:
    """Refuse a degree that splits one of the built-in GPT's heads or its MLP width.

    Raises `ConfigError` naming the degrees (dividing the world) that work.
    """
    if tp <= 1 or (n_head % tp == 0 and (4 * n_embd) % tp == 0):
        return
    good = [d for d in divisors(world_size) if n_head % d == 0 and (4 * n_embd) % d == 0]
    raise ConfigError(
        f"parallel.tp = {tp} does not divide the built-in GPT's {n_head} heads (model.n_head) "
        f"into whole heads per rank; use one of {good}, or a model.n_head that divides by {tp}."
    )


def dp_coordinates(rank: int, world_size: int, tp: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of `rank`: the ranks of one TP group
    (consecutive ranks) share one data-parallel rank, so they read the same batch."""
    return rank // tp, world_size // tp


def plan_matches(pattern: str, name: str) -> bool:
    """Whether a plan's `pattern` (dotted parts, `*` for any one part) names the module
    `name`: the one reading of a plan, for the split (`parallel.tensor_parallel`) and the
    planner (`plan.tp_count`)."""
    want, parts = pattern.split("."), name.split(".")
    return len(want) == len(parts) and all(w in ("*", p) for w, p in zip(want, parts, strict=True))
