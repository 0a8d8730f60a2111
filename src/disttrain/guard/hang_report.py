"""From heartbeats and stacks to one hang summary that names the lagging rank (P-DEBUG-1).

Pure functions on plain data (the heartbeat dicts written by `watchdog.Watchdog`), so
the reasoning is unit-testable without processes. The rules, in order:

1. A rank whose heartbeat stopped, or that the kernel shows stopped, lags: it is
   frozen (SIGSTOP, a debugger, a GIL-holding extension) or dead.
2. A rank that moved past a step without entering a phase that the other ranks
   entered at that step skipped it: a rank-specific branch around a collective.
3. Ranks at an earlier step than the others lag (often data loading, P-DEBUG-4).
4. At the same step, ranks outside the phase where most ranks wait lag.
5. Everyone in the same step and phase (or in different phases, none of them most
   ranks'): the stacks decide when they are known. Ranks whose main thread is not in
   a collective, while the others' is, stopped making progress in Python code (a
   loop, a sleep, a lock) and lag; otherwise a communication problem.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

_SIGNALS = {
    "T": "stopped (SIGSTOP or a debugger)",
    "t": "stopped by a tracer",
    "Z": "dead (zombie)",
    "D": "in uninterruptible I/O",
}


def _skipped(beats: list[dict]) -> list[tuple[int, str, int | None]]:
    """(rank, phase, step or None) for each phase a rank moved past without entering.

    A rank skipped phase P when another rank entered P more often, and this rank is
    already past the step of that rank's last entry of P (so it is not merely behind).
    The step is named when the kept history still covers it.
    """
    found = []
    phases = sorted(set().union(*(b.get("counts", {}) for b in beats)))
    for phase in phases:
        for b in beats:
            mine = b.get("counts", {}).get(phase, 0)
            ahead = [
                o
                for o in beats
                if o is not b
                and o.get("counts", {}).get(phase, 0) > mine
                and o.get("history", {}).get(phase)
                and b["step"] > o["history"][phase][-1]
            ]
            if not ahead:
                continue
            kept = set(b.get("history", {}).get(phase, []))
            oldest = min(kept) if kept else -1
            others = set().union(*(o["history"][phase] for o in ahead))
            missing = sorted(s for s in others if s > oldest and s not in kept and s < b["step"])
            found.append((b["rank"], phase, missing[0] if missing else None))
    return found


def diagnose(
    beats: list[dict], now: float, stale_after: float, stacks: dict[int, str] | None = None
) -> tuple[str, list[int]]:
    """(verdict sentence, lagging ranks) from every rank's last heartbeat, and from the
    ranks' stack dumps (`stacks`, by rank) where the heartbeats single out none."""
    verdict, lagging = _by_beats(beats, now, stale_after)
    if not lagging and stacks:
        return _by_stacks(beats, stacks) or (verdict, lagging)
    return verdict, lagging


COLLECTIVE_WORDS = (
    "all_reduce",
    "allreduce",
    "all_gather",
    "allgather",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "all_to_all",
    "alltoall",
    "isend",
    "irecv",
    "c10d",
    "_functional_collectives",
    "_fully_shard/",
    "torch/nn/parallel/distributed.py",
    "_engine_run_backward",
)
"""Words of a frame that waits for the other ranks: a collective or point-to-point op
(torch.distributed's API and its logging wrapper are `distributed_c10d.py` and
`c10d_logger.py`), functional collectives, FSDP2's unshard and reduce waits, DDP's
forward (its buffer broadcast) and autograd's engine (under DDP a backward ends waiting
for the gradient all-reduce, inside the engine's C++). Not the rest of
torch.distributed: a checkpoint's file writes are work, not a wait."""


def in_collective(frames: list[str]) -> bool:
    """Whether a main thread whose frames are `frames` (innermost first, each naming its
    function and file) waits for the other ranks: its innermost frame is a collective.
    Only the innermost: a collective's code can import or compute on the way in, and
    such a thread is busy, not waiting."""
    return bool(frames) and any(w in frames[0].lower() for w in COLLECTIVE_WORDS)


def _by_stacks(beats: list[dict], stacks: dict[int, str]) -> tuple[str, list[int]] | None:
    """(verdict, lagging) when some ranks' main threads wait in a collective and others'
    do not; None when the stacks cannot tell (unknown, or all alike)."""
    known = {b["rank"]: main_frames(stacks[b["rank"]]) for b in beats if stacks.get(b["rank"])}
    known = {r: f for r, f in known.items() if f}
    waiting = {r for r, frames in known.items() if in_collective(frames)}
    lagging = sorted(set(known) - waiting)
    if len(known) >= 2 and waiting == set(known):
        return _mismatched(stacks, sorted(waiting))
    if len(known) < 2 or not waiting or not lagging:
        return None
    where = "; ".join(f"rank {r} at {where_in_stack(stacks[r])}" for r in lagging)
    return (
        f"rank(s) {lagging} are not in a collective while rank(s) {sorted(waiting)} wait in one: "
        f"they stopped making progress in their own code ({where})."
    ), lagging


def _mismatched(stacks: dict[int, str], ranks: list[int]) -> tuple[str, list[int]] | None:
    """(verdict, no lagging rank) when every rank waits in a collective but not in the
    same call (another collective, or the same one from another line): the program's
    collectives do not match; None when they all wait in the same call."""
    where = {r: where_in_stack(stacks[r]) for r in ranks}
    if len(set(where.values())) < 2:
        return None
    each = "; ".join(f"rank {r} in {w}" for r, w in where.items())
    return (
        f"every rank waits in a collective, but not in the same call ({each}): the program's "
        f"collectives do not match across ranks (a rank-specific branch around a collective, "
        f"or ranks that call them in another order), not the network."
    ), []


def _by_beats(beats: list[dict], now: float, stale_after: float) -> tuple[str, list[int]]:
    """Rules 1 to 5 of the module docstring, on the heartbeats alone."""
    running = [b for b in beats if b.get("state") == "running"]
    frozen = [b for b in running if b.get("proc_state") in _SIGNALS or now - b["alive"] > stale_after]
    if frozen:
        parts = [
            f"rank {b['rank']} is {_SIGNALS.get(b.get('proc_state') or '', 'not responding')}: "
            f"no heartbeat for {now - b['alive']:.1f} s (the last one was at step {b['step']}, "
            f"phase {b['phase']!r}; its stack below shows where it is now)"
            for b in frozen
        ]
        return "; ".join(parts) + ". The others wait for it.", [b["rank"] for b in frozen]
    skipped = _skipped(beats)
    if skipped:
        ranks = sorted({r for r, _, _ in skipped})
        parts = [
            f"rank {r} skipped phase {p!r} "
            + (f"at step {s}" if s is not None else "(before the steps its history keeps)")
            for r, p, s in skipped
        ]
        return (
            "; ".join(parts) + " while the other ranks entered it: a rank-specific branch "
            "around a collective leaves the others waiting (or pairs mismatched "
            "collectives)."
        ), ranks
    exited = [b for b in beats if b.get("state") == "exited"]
    if exited:
        return (
            f"rank(s) {[b['rank'] for b in exited]} already left the training loop while "
            f"the others wait in a collective."
        ), [b["rank"] for b in exited]
    steps = {b["step"] for b in beats}
    if len(steps) > 1:
        low = min(steps)
        lag = [b["rank"] for b in beats if b["step"] == low]
        return (
            f"rank(s) {lag} are behind at step {low} (others reached step {max(steps)}); "
            f"a slow rank, often its data loading (P-DEBUG-4)."
        ), lag
    phases = Counter(b["phase"] for b in beats)
    if len(phases) > 1:
        # Ranks that have not yet entered, at this step, the phase another rank waits in.
        behind = [
            b["rank"]
            for b in beats
            if any(
                o is not b
                and o["step"] in o.get("history", {}).get(o["phase"], [])
                and b["step"] not in b.get("history", {}).get(o["phase"], [])
                for o in beats
            )
        ]
        if behind and len(behind) < len(beats):
            where = ", ".join(f"rank {b['rank']} in {b['phase']!r}" for b in beats)
            return (
                f"rank(s) {behind} have not reached, at step {min(steps)}, the phase the others "
                f"wait in ({where}): they lag, often in data loading (P-DEBUG-4)."
            ), behind
        ((common, n),) = phases.most_common(1)
        if n > len(beats) / 2:
            lag = [b["rank"] for b in beats if b["phase"] != common]
            where = ", ".join(f"rank {b['rank']} in {b['phase']!r}" for b in beats if b["rank"] in lag)
            return (f"{where}, while the others wait in {common!r}: those ranks lag."), lag
        where = ", ".join(f"rank {b['rank']} in {b['phase']!r}" for b in beats)
        return f"ranks are in different phases at the same step ({where}).", []
    return (
        "every rank waits in the same step and phase: a communication problem (network, "
        "NCCL, a dead peer on another host), not a lagging rank. Rerun with "
        "`disttrain run --debug` (P-DEBUG-2)."
    ), []


def main_frames(stack: str) -> list[str]:
    """The main thread's frames, innermost first, of a py-spy or faulthandler dump."""
    lines = stack.splitlines()
    heads = [i for i, line in enumerate(lines) if "MainThread" in line or line.startswith("Current thread")]
    if not heads:
        heads = [i for i, line in enumerate(lines) if line.startswith("Thread")]
    if not heads:
        return []
    frames = []
    for frame in lines[heads[0] + 1 :]:
        frame = frame.strip()
        if not frame or frame.startswith(("Thread", "Current thread")):
            break
        frames.append(frame.removeprefix("File "))
    return frames


def where_in_stack(stack: str) -> str:
    """The main thread's innermost frame (and first frame outside torch) in a py-spy
    dump ('... "MainThread"') or a faulthandler dump ('Current thread ...': signal
    handlers run on the main thread)."""
    frames = main_frames(stack)
    if not frames:
        return ""
    # The innermost frame is usually torch's; the first frame outside torch is the
    # caller that matters (the user's or disttrain's line).
    own = next((f for f in frames if "torch/" not in f and "site-packages" not in f), "")
    return frames[0] + (f", called from {own}" if own and own != frames[0] else "")


def format_summary(
    *,
    reason: str,
    reporter: int,
    world: int,
    beats: list[dict],
    verdict: str,
    lagging: list[int],
    stacks: dict[int, str],
    report: Path,
) -> str:
    """The one summary a hang prints: why it fired, who lags, where every rank is."""
    seen = {b["rank"] for b in beats}
    lines = [
        f"disttrain guard: HANG detected by rank {reporter}: {reason}.",
        f"Lagging rank(s): {', '.join(map(str, lagging)) if lagging else 'none singled out'}. {verdict}",
        "Where each rank is:",
    ]
    for b in beats:
        state = b.get("proc_state", "")
        extra = f" [process state {state}]" if state and state not in "RS" else ""
        frame = where_in_stack(stacks.get(b["rank"], ""))
        lines.append(
            f"  rank {b['rank']} (pid {b['pid']} on {b['host']}){extra}: step {b['step']}, "
            f"phase {b['phase']!r} for {b['phase_elapsed']:.1f} s"
            + (f"; at {frame}" if frame else "")
            + ("" if b.get("state") == "running" else f" ({b.get('state')})")
        )
    missing = sorted(set(range(world)) - seen)
    if missing:
        lines.append(
            f"  rank(s) {missing}: no heartbeat on this host's side channel "
            f"(other hosts: set guard.dir to a shared directory)."
        )
    lines.append(f"Full stacks: {report}. Stopping the job now instead of waiting for the collective timeout.")
    return "\n".join(lines)
