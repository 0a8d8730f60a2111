"""What one synchronising call of a rank is, in words, and what must be equal across
ranks: the fingerprints that `collective_watch` exchanges through `sequence`.

An `Event` is one of a rank's calls that every rank of a group must make at the same
place in its sequence: a collective of `torch.distributed` (its name, the shapes and
dtypes of its tensors, the reduce op, the root rank), an optimizer step, or the end of
the rank's script. `match` holds what must be equal on every rank; `shown` says the same
in the user's words; `line` is the user's line of the call (lines may differ: the same
collective called from two branches is correct).

What must be equal, per collective, is what the backends require: the same shape and
dtype for the tensors every rank passes alike (all_reduce, broadcast, reduce, the
outputs of all_gather, both sides of all_gather_into_tensor, reduce_scatter_tensor and
their `_single` forms),
the same reduce op and root. Arguments that differ by design are left out: the split
sizes of all_to_all_single (only the dtype is compared), the gather and scatter lists
(only the root rank's), the objects of the `*_object` collectives (only their count
where every rank passes one).

`mismatch_text` turns the events of one place in the sequence into the message of a
stop, or None when they match.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from disttrain.json_text import loads

COLLECTIVE, STEP, END = "collective", "step", "end"
"""The kinds of event."""

SPECS: dict[str, tuple[tuple[str, str], ...]] = {
    # function -> (parameter, how it is compared): "tensor" / "tensors" (shape and dtype),
    # "dtype" (only the dtype: sizes that differ by design), "count" (how many), "value".
    "all_reduce": (("tensor", "tensor"), ("op", "value")),
    "broadcast": (("tensor", "tensor"), ("src", "value"), ("group_src", "value")),
    "reduce": (("tensor", "tensor"), ("op", "value"), ("dst", "value"), ("group_dst", "value")),
    "all_gather": (("tensor_list", "tensors"), ("tensor", "dtype")),
    "all_gather_into_tensor": (("output_tensor", "tensor"), ("input_tensor", "tensor")),
    "all_gather_single": (("output_tensor", "tensor"), ("input_tensor", "tensor")),
    "reduce_scatter": (("output", "tensor"), ("input_list", "tensors"), ("op", "value")),
    "reduce_scatter_tensor": (("output", "tensor"), ("input", "tensor"), ("op", "value")),
    "reduce_scatter_single": (("output", "tensor"), ("input", "tensor"), ("op", "value")),
    "gather": (("tensor", "tensor"), ("dst", "value"), ("group_dst", "value")),
    "scatter": (("tensor", "tensor"), ("src", "value"), ("group_src", "value")),
    "all_to_all": (("output_tensor_list", "count"), ("input_tensor_list", "count")),
    "all_to_all_single": (("output", "dtype"), ("input", "dtype")),
    "barrier": (),
    "monitored_barrier": (),
    "all_gather_object": (),
    "gather_object": (("dst", "value"), ("group_dst", "value")),
    "broadcast_object_list": (("object_list", "count"), ("src", "value"), ("group_src", "value")),
    "scatter_object_list": (("src", "value"), ("group_src", "value")),
}
"""The collectives of `torch.distributed` that are checked (point-to-point ops are not:
their two sides differ by design)."""

MAX_FIELD = 400
"""The longest text of a field read from another rank's event (longer is cut)."""


@dataclass(frozen=True)
class Event:
    """One place in a rank's sequence (see the module)."""

    kind: str
    op: str = ""
    match: str = ""
    shown: str = ""
    line: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(raw: bytes) -> Event | None:
        """The event another rank wrote; None for anything that is not one (never raises)."""
        try:
            value = loads(raw[:4096], max_depth=2)
        except ValueError:
            return None
        if not isinstance(value, Mapping) or value.get("kind") not in (COLLECTIVE, STEP, END):
            return None
        fields = {k: str(value.get(k, ""))[:MAX_FIELD] for k in ("op", "match", "shown", "line")}
        return Event(kind=str(value["kind"]), **fields)


def _tensor(t: Any) -> str:
    """'float32 [3, 4]' ('float32 []' for a scalar)."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).removeprefix('torch.')} [{', '.join(map(str, t.shape))}]"


def _value(v: Any) -> str:
    return str(getattr(v, "name", None) or v)  # a ReduceOp's name: SUM, MAX


def _part(name: str, how: str, value: Any) -> tuple[str, str] | None:
    """(what must match, the words) of one argument; None for an argument not given."""
    if value is None:
        return None
    if how == "tensor":
        text = _tensor(value)
        return f"{name}={text}", f"{name} {text}"
    if how == "dtype":
        text = str(getattr(value, "dtype", type(value).__name__)).removeprefix("torch.")
        return f"{name}:{text}", f"{text} {name}"
    if how in ("tensors", "count"):
        items = list(value) if isinstance(value, (list, tuple)) else []
        if how == "count":
            return f"{name}#{len(items)}", f"{name} of {len(items)}"
        each = [_tensor(t) for t in items]
        text = f"{len(each)} x {each[0]}" if each and len(set(each)) == 1 else ", ".join(each)
        return f"{name}=[{text}]", f"{name} {text}"
    text = _value(value)
    return f"{name}={text}", f"{name} {text}"


def collective(op: str, arguments: Mapping[str, Any], line: str | None) -> Event:
    """The event of a call of `torch.distributed.<op>` with its bound `arguments`."""
    parts = [_part(name, how, arguments.get(name)) for name, how in SPECS.get(op, ())]
    given = [p for p in parts if p is not None]
    return Event(COLLECTIVE, op, ";".join(m for m, _ in given), ", ".join(w for _, w in given), line or "")


def describe(rank_words: str, e: Event) -> str:
    """'rank 0 calls all_reduce (tensor float32 [3], op SUM) at train.py:40'."""
    at = f" at {e.line}" if e.line else ""
    if e.kind == STEP:
        return f"{rank_words} step{'s' if _one(rank_words) else ''} the optimizer{at}"
    if e.kind == END:
        return f"{rank_words} {'has' if _one(rank_words) else 'have'} {e.shown or 'finished'}{at}"
    args = f" ({e.shown})" if e.shown else ""
    return f"{rank_words} call{'s' if _one(rank_words) else ''} {e.op}{args}{at}"


def _one(rank_words: str) -> bool:
    return rank_words.startswith("rank ")


def ranks_words(ranks: list[int]) -> str:
    """'rank 1' / 'ranks 0, 2' / 'ranks 0, 1, ... (12 ranks)'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(map(str, ranks[:6]))
    return f"ranks {shown}" + (f", ... ({len(ranks)} ranks)" if len(ranks) > 6 else "")


def _groups(events: list[Event], members: list[int]) -> list[tuple[list[int], Event]]:
    """The members grouped by what they do at this place (first rank's group first)."""
    out: dict[tuple[str, str, str], tuple[list[int], Event]] = {}
    for rank, e in zip(members, events, strict=True):
        out.setdefault((e.kind, e.op, e.match), ([], e))[0].append(rank)
    return list(out.values())


def mismatch_text(events: list[Event], members: list[int], where: str) -> str | None:
    """The stop's message when the members' `events` (in `members` order) at one place
    of their sequence differ; None when they match. `where`: the place in words."""
    groups = _groups(events, members)
    if len(groups) == 1:
        return None
    each = "; ".join(describe(ranks_words(ranks), e) for ranks, e in groups)
    calls = [(ranks, e) for ranks, e in groups if e.kind == COLLECTIVE]
    if len(calls) == len(groups) and len({e.op for _, e in calls}) == 1:
        op = calls[0][1].op
        return (
            f"{where}: {each}: the ranks' {op} arguments differ; every rank must pass tensors of "
            f"the same shape and dtype, the same reduce op and root, or the {op} hangs, fails or "
            "returns wrong numbers. Fix: make them equal on every rank (pad uneven data, or "
            "all_gather the sizes first)."
        )
    if not calls and {e.kind for _, e in groups} == {STEP, END}:
        return (
            f"{where}: {each}: the ranks take a different number of optimizer steps (a loader with "
            "more batches on some ranks, a break on some ranks only); the ranks still training wait "
            "forever in their next collective (DDP's gradient all-reduce among them). Fix: give every "
            "rank the same number of batches (DistributedSampler, drop_last=True), or end the loop on "
            "every rank at once (torch.distributed.algorithms.Join for uneven data)."
        )
    if len(calls) == 1:
        ranks, e = calls[0]
        ended = sorted(r for rs, other in groups if other.kind == END for r in rs)
        alone = f"the {e.op}{f' at {e.line}' if e.line else ''} runs on {ranks_words(ranks)} only"
        if ended:
            return (
                f"{where}: {each}: {alone}, and {ranks_words(ended)} will never "
                "join it: it would hang. A return, break or sys.exit on some ranks only leaves "
                "the others waiting. Fix: every rank must make the same collectives; end every "
                "rank's loop at the same point, after its last collective."
            )
        return (
            f"{where}: {each}: {alone} (under a rank condition?) and would hang. Fix: call it on "
            "every rank (compute the value everywhere, print it on rank 0 only)."
        )
    return (
        f"{where}: {each}: the ranks do not call the same collectives in the same order (one "
        "runs on some ranks only, or in another order); they would hang or exchange the wrong "
        "tensors. Fix: call every collective on every rank, in the same order."
    )
