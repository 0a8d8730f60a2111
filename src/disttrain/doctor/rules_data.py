"""Rules about what each rank's loader hands it: the rank data is sharded by, batches
the ranks do not all get.

Each check takes `Facts` and yields `Finding`s; each stays silent unless the source
shows the pitfall (a false positive is a bug: when in doubt, say nothing).
"""

from __future__ import annotations

import ast

from disttrain.doctor.facts import Facts, is_const, kwarg, mentions, ref
from disttrain.doctor.findings import WARNING, finding, rule
from disttrain.doctor.rank_names import LOCAL_RANK_ENV, is_local_word


def reads_local_rank(facts: Facts, value: ast.AST) -> bool:
    """`value` is a LOCAL_RANK read, or a name assigned only from one in its file."""

    def local_read(v: ast.AST) -> bool:
        return any(isinstance(n, ast.Constant) and n.value in LOCAL_RANK_ENV for n in ast.walk(v))

    if local_read(value):
        return True
    name = ref(value)
    assigned = [
        n.value for n in facts.nodes if isinstance(n, ast.Assign) and name and any(ref(t) == name for t in n.targets)
    ]
    return bool(assigned) and all(local_read(v) for v in assigned)


def _local_rank_value(facts: Facts, value: ast.AST) -> bool:
    """`value` reads the node-local rank (`args.local_rank`, LOCAL_RANK, a name read from
    it), and no global rank (`rank`, `get_rank()`) alongside."""
    words = [
        w
        for n in ast.walk(value)
        if (w := (n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else None))
    ]
    local = any(is_local_word(w) for w in words) or reads_local_rank(facts, value)
    global_too = any("rank" in w.lower() and not is_local_word(w) for w in words)
    return local and not global_too


def _words(value: ast.AST) -> list[str]:
    return [
        w
        for n in ast.walk(value)
        if (w := (n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else None))
    ]


def _local_index(facts: Facts, value: ast.AST) -> bool:
    """The node-local rank, or Accelerate's `local_process_index`."""
    words = _words(value)
    return _local_rank_value(facts, value) or (
        "local_process_index" in words and not any("rank" in w.lower() or w == "process_index" for w in words)
    )


def _global_count(value: ast.AST) -> bool:
    """The number of processes in the whole job (not one node's)."""
    words = [w.lower() for w in _words(value)]
    return any(w in ("num_processes", "world_size", "get_world_size") for w in words) and not any(
        "local" in w or "node" in w for w in words
    )


def rank_kwarg_calls(facts: Facts, name: str, is_local):
    """Calls to `name` whose `rank=` argument `is_local(facts, value)` says is the local rank."""
    for call in facts.calls_to(name):
        value = kwarg(call, "rank")
        if value is not None and is_local(facts, value):
            yield call, value


@rule(
    "shard-by-local-rank",
    ("P-DATA-1",),
    WARNING,
    "data sharded by the node-local rank",
    """A DistributedSampler (or a dataset's own shard) told `rank=local_rank` with
      `num_replicas` the world size picks the same shards on every node: launched on
      several nodes, node 2 trains on node 1's data and the other shards are never seen
      (and an evaluation sharded so counts samples twice). Shard by the global rank
      (`dist.get_rank()`, RANK); the local rank only picks the GPU.""",
)
def shard_by_local_rank(facts: Facts):
    yield from _sliced_by_local_index(facts)  # a slice over the job's count: several ranks by itself
    if not any(f.distributed for f in facts.project.component(facts)):
        return
    for call, value in rank_kwarg_calls(facts, "DistributedSampler", _local_rank_value):
        yield finding(
            facts,
            call,
            "shard-by-local-rank",
            f"DistributedSampler(rank={ast.unparse(value)}) shards by the node-local "
            "rank: on several nodes every node reads the same shards.",
            "pass rank=dist.get_rank() (the global rank).",
        )
    for n in facts.nodes:
        if (
            isinstance(n, ast.Assign)
            and any(
                "shard" in (ref(t) or "").rsplit(".", 1)[-1].lower() and "num" not in (ref(t) or "").lower()
                for t in n.targets
            )
            and _local_rank_value(facts, n.value)
        ):
            yield finding(
                facts,
                n,
                "shard-by-local-rank",
                f"`{ast.unparse(n.targets[0])}` is the node-local rank: on several nodes every "
                "node reads the same data shards and the others are never trained on.",
                "shard by the global rank (dist.get_rank(), RANK).",
            )


def _sliced_by_local_index(facts: Facts):
    for n in facts.nodes:
        s = n.slice if isinstance(n, ast.Subscript) else None
        if (
            isinstance(s, ast.Slice)
            and s.lower is not None
            and s.step is not None
            and _local_index(facts, s.lower)
            and _global_count(s.step)
        ):
            yield finding(
                facts,
                n,
                "shard-by-local-rank",
                f"`{ast.unparse(n)}` picks one of the world's slices by the node-local index: "
                "on several nodes every node trains the same slices and the others are never seen.",
                "slice by the global rank (dist.get_rank(), accelerator.process_index).",
            )


@rule(
    "uneven-batches",
    ("P-DATA-1",),
    WARNING,
    "Accelerate's even_batches turned off under DDP",
    """`Accelerator(even_batches=False)` (or `accelerator.even_batches = False`) lets the
      ranks get different numbers of batches when the batch count does not divide by the
      number of processes (a batch sampler that keeps its last, smaller batch). Under DDP
      the ranks with one more batch run its backward alone and wait in the gradient
      all-reduce for ranks that already left the loop. Keep even_batches on, or wrap the
      loop in `accelerator.join_uneven_inputs([model])`.""",
)
def uneven_batches(facts: Facts):
    if not facts.method_calls("backward"):
        return  # no training step here (an evaluation script): uneven batches are harmless
    if facts.method_calls("join_uneven_inputs") or any(
        any(w in (ref(c.func.value) or "").lower() for w in ("model", "ddp"))  # type: ignore[attr-defined]
        for c in facts.method_calls("join")
    ):
        return  # the loop joins uneven inputs (DDP's model.join())
    for call in facts.calls_to("accelerate.Accelerator"):
        value = kwarg(call, "even_batches")
        if value is not None and is_const(value, False):
            yield finding(facts, call, "uneven-batches", _MSG, _FIX)
    for n in facts.nodes:
        if (
            isinstance(n, ast.Assign)
            and is_const(n.value, False)
            and any(
                isinstance(t, ast.Attribute)
                and t.attr == "even_batches"
                and mentions(t.value, lambda w: "accelerator" in w.lower())
                for t in n.targets
            )
        ):
            yield finding(facts, n, "uneven-batches", _MSG, _FIX)


_MSG = (
    "even_batches is off: when the batches do not divide evenly, some ranks get one more, "
    "run its backward alone and wait in the all-reduce for ranks that already finished."
)
_FIX = "keep even_batches on, or train inside accelerator.join_uneven_inputs([model])."
