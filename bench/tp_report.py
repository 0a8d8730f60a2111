"""bench/results/tp.md from one run of bench/tp_bench.py: step times, the planner's
memory per device against each rank's, and the activation all-reduces counted."""

from __future__ import annotations

import statistics

from disttrain.builtin import GPTConfig
from disttrain.plan import estimate
from disttrain.plan.memory import fmt_bytes

PARTS = ("params", "grads", "optim", "activations")


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f} ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})"


def _flat(rounds: list[list[float]]) -> list[float]:
    return [t for r in rounds for t in r]


def speed_tables(times: dict[str, list[list[float]]], tokens: int) -> list[str]:
    """The disttrain-against-torch table, then the three layouts'."""
    hand = times["torch tp2 x dp2"]
    rows = (
        ("torch by hand (`parallelize_module` + `fully_shard`)", hand, ""),
        ("torch by hand again (the control: the noise)", times["torch tp2 x dp2 control"], "(1.00)"),
        ('disttrain (`dt.wrap(strategy="fsdp", tp=2)`)', times["disttrain tp2 x dp2"], "<= 1.02"),
    )
    out = [
        "| tp 2 x dp 2, 4 gloo ranks | ms/step, median (min-max) | / torch | same turn: median (quartiles) "
        "| per round | target |",
        "|---|---|---|---|---|---|",
    ]
    for what, mine, target in rows:
        if mine is hand:
            out.append(f"| {what} | {_ms(_flat(hand))} | | | | |")
            continue
        ratio = statistics.median(_flat(mine)) / statistics.median(_flat(hand))
        paired = sorted(a / b for a, b in zip(_flat(mine), _flat(hand), strict=True))
        q = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
        rounds = ", ".join(
            f"{statistics.median(a) / statistics.median(b):.2f}" for a, b in zip(mine, hand, strict=True)
        )
        out.append(
            f"| {what} | {_ms(_flat(mine))} | **{ratio:.3f}** | {statistics.median(paired):.3f} "
            f"({q[0]:.2f}-{q[2]:.2f}) | {rounds} | {target} |"
        )
    out += [
        "",
        "/ torch: the ratio of the medians; same turn: of each step to the torch step of its turn.",
        "",
        "| disttrain, same global batch | ms/step, median (min-max) | tokens/s | vs tp 1 x dp 4 |",
        "|---|---|---|---|",
    ]
    base = statistics.median(_flat(times["disttrain tp1 x dp4"]))
    for name in ("disttrain tp1 x dp4", "disttrain tp2 x dp2", "disttrain tp4 x dp1"):
        med = statistics.median(_flat(times[name]))
        out.append(f"| {name.split(' ', 1)[1]} | {_ms(_flat(times[name]))} | {tokens / med:,.0f} | {med / base:.2f}x |")
    return out


def memory_table(measured: list[dict], layouts: dict[str, int], cfg: GPTConfig, world: int, batch: int) -> list[str]:
    """Planned against measured bytes per device (the worst rank), per part."""
    out = [
        "| layout | part | planned | measured (worst rank) | planned / measured |",
        "|---|---|---|---|---|",
    ]
    for name, tp in layouts.items():
        if not name.startswith("disttrain"):
            continue
        row = estimate(cfg, devices=world, batch_per_device=batch // (world // tp), seq_len=cfg.block_size).get_tp(tp)
        worst = {p: max(rank[name][p] for rank in measured) for p in PARTS}
        layout = name.split(" ", 1)[1]
        for part in (*PARTS, "sum"):
            plan = sum(getattr(row, p) for p in PARTS) if part == "sum" else getattr(row, part)
            got = sum(worst.values()) if part == "sum" else worst[part]
            out.append(f"| {layout} | {part} | {fmt_bytes(plan)} | {fmt_bytes(got)} | {plan / got:.3f} |")
        out.append(f"| {layout} | buffers (planned only) | {fmt_bytes(row.buffers)} | - | - |")
    return out


def memory_summary(measured: list[dict], layouts: dict[str, int], cfg: GPTConfig, world: int, batch: int) -> list[str]:
    """One row per layout: the planned state and activations against the ranks' (worst rank)."""
    out = [
        "| planner vs ranks, per device | state planned / measured | activations planned / measured "
        "| planned total with buffers |",
        "|---|---|---|---|",
    ]
    for name, tp in layouts.items():
        if name.startswith("disttrain"):
            row = estimate(cfg, devices=world, batch_per_device=batch // (world // tp), seq_len=cfg.block_size)
            plan = row.get_tp(tp)
            state = max(sum(rank[name][p] for p in PARTS[:3]) for rank in measured)
            acts = max(rank[name]["activations"] for rank in measured)
            out.append(
                f"| {name.split(' ', 1)[1]} | {fmt_bytes(plan.params + plan.grads + plan.optim)} / {fmt_bytes(state)} "
                f"| {fmt_bytes(plan.activations)} / {fmt_bytes(acts)} ({plan.activations / acts:.2f}x) "
                f"| {fmt_bytes(plan.total)} |"
            )
    return out


def comm_table(comms: dict[str, dict[str, int]], layouts: dict[str, int], cfg: GPTConfig, world: int) -> list[str]:
    """All-reduces per step: counted by CommDebugMode against the planner's count."""
    linears = estimate(cfg, devices=world).model.tp_linears
    out = ["| layout | all-reduces fwd (planned) | all-reduces bwd (planned) |", "|---|---|---|"]
    for name, tp in layouts.items():
        fwd = sum(s == "rowwise" for s, _, _ in linears) if tp > 1 else 0
        bwd = sum(s == "colwise" for s, _, _ in linears) if tp > 1 else 0
        got = comms[name]
        out.append(f"| {name} | {got['fwd']} ({fwd}) | {got['bwd']} ({bwd}) |")
    return out


def render(data: dict, *, model: dict, world: int, global_batch: int, layouts) -> str:
    """The whole of tp.md from the run's `data` (times, memory, comms, command, machine)."""
    command, machine = data["command"], data["machine"]
    cfg = GPTConfig(**model)
    tokens = global_batch * cfg.block_size
    rounds = len(next(iter(data["times"].values())))
    steps = len(data["times"]["torch tp2 x dp2"][0])
    lines = [
        "<!-- headline -->",
        "# Tensor parallel x FSDP on CPU: disttrain against torch by hand, and when TP pays",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine['cores']} cores ({machine['cpu']}), torch {machine['torch']}; {machine['date']}; "
        f"1-minute load {machine['load_1min']} at the start. The built-in GPT ({cfg.n_layer} layers, width "
        f"{cfg.n_embd}, {cfg.n_head} heads, context {cfg.block_size}), fp32, AdamW, {world} gloo ranks with one "
        f"thread each, a global batch of {global_batch} sequences ({tokens} tokens) per step; {rounds} rounds, "
        f"each of {steps} turns in which every layout takes one step (in a new random order), after 2 "
        "warm-up steps each. Step time: rank 0's wall time from a barrier to the end of the optimizer step.",
        "",
        *speed_tables(data["times"], tokens),
        "",
        *memory_summary(data["memory"], layouts, cfg, world, global_batch),
        "<!-- /headline -->",
        "",
        "## The planner against the ranks",
        "",
        "`disttrain plan`'s TP rows (`estimate(..., devices=4, batch_per_device=16 / dp).get_tp(tp)`) "
        "against what the ranks hold: parameters and optimizer state (the local storage of each "
        "DTensor shard) after a step, gradients after a backward, and the activations one forward "
        "saves for backward (autograd's saved-tensor hooks, each storage once, parameters and "
        "their views left out). Transient buffers (FSDP's all-gathered blocks, collective "
        "buffers) are planned but not measured on CPU.",
        "",
        *memory_table(data["memory"], layouts, cfg, world, global_batch),
        "",
        "## Activation all-reduces per step",
        "",
        "Counted by torch's `CommDebugMode` over one forward and one backward on rank 0; in "
        "parentheses the planner's count (a row split's output in forward, a column split's "
        "input gradient in backward, per planned layer).",
        "",
        *comm_table(data["comms"], layouts, cfg, world),
        "",
    ]
    return "\n".join(lines)
