"""Which names read as ranks when no data flow says so, and which rank tests rest on a
name alone.

A rank guard is proven when data flow reaches its value (`rank = dist.get_rank()`, a
flag computed from one, a function that returns one: rank_values.py) or a library
defines it (`dist.get_rank()`, `accelerator.is_main_process`). Otherwise the doctor can
only read the words: a flag (`is_main`, `rank0`), the bare name of a rank number (`rank`,
`args.local_rank`), or another name with "rank" in it compared like a number
(`self.peer_rank == 0`). Only an attribute named as a rank number (`args.local_rank`,
which launchers fill) counts without data flow; a plain `rank` whose value is set out of
view is a rank by its name alone. A setting named after ranks and tested for its truth (`if
self.negatives_across_rank:`, the same on every rank) is no rank. `named_only` says when
a test rests on such words alone, so a rule can make its finding a warning that says so.
"""

from __future__ import annotations

import ast

from disttrain.doctor.names import ref as _ref
from disttrain.doctor.names import word as _word

# The environment variables launchers set to a process's rank: torchrun's, SLURM's (srun
# sets one task per process), Open MPI's, MPICH/PMI's, MVAPICH's, Horovod's, PALS'.
GLOBAL_RANK_ENV = (
    "RANK",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "PMIX_RANK",
    "MV2_COMM_WORLD_RANK",
    "HOROVOD_RANK",
)
LOCAL_RANK_ENV = (
    "LOCAL_RANK",
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "HOROVOD_LOCAL_RANK",
    "PALS_LOCAL_RANKID",
)


def env_rank_kind(key: object) -> str | None:
    """ "global" or "local" for the name of a launcher's rank variable, else None."""
    return "local" if key in LOCAL_RANK_ENV else "global" if key in GLOBAL_RANK_ENV else None


# Words that make an `if` test a rank guard: `if rank == 0`, `if dist.get_rank() == 0`,
# `if is_main_process():`, `if accelerator.is_main_process`, `if trainer.is_global_zero`.
_GUARD_WORDS = (
    "rank",
    "is_main",
    "main_process",
    "is_master",
    "master_process",
    "is_primary",
    "primary_process",
    "is_global_zero",
    "is_chief",
    "rank0",
    "rank_zero",
    "main_only",
    "master_only",
)


def is_local_word(word: str) -> bool:
    low = word.lower()
    # a GPU index, or Accelerate's `is_local_main_process`: one process per node
    return ("local" in low and any(w in low for w in ("rank", "main", "master"))) or low == "gpu_id"


def is_guard_word(text: str) -> bool:
    low = text.lower()
    return any(w in low for w in _GUARD_WORDS) and not _rank_quantity(low)


# `val_av_rank_start_epoch` (the epoch a ranking metric starts), `lora_rank`: the word
# "rank" in a name that is no process rank.
_NOT_RANK_AFTER = {
    "epoch",
    "epochs",
    "step",
    "steps",
    "iter",
    "iters",
    "start",
    "freq",
    "interval",
    "bsz",
    "neg",
    "qs",
    "max",
    "min",
    "topk",
    "loss",
    "score",
    "metric",
}
_NOT_RANK_BEFORE = {"lora", "av", "avg", "mean", "matrix", "low"}


def _rank_quantity(low: str) -> bool:
    parts = low.split("_")
    at = [i for i, w in enumerate(parts) if w == "rank"]
    if not at or any(w in low for w in _GUARD_WORDS if w != "rank"):
        return False
    i = at[-1]
    return bool(set(parts[i + 1 :]) & _NOT_RANK_AFTER or set(parts[:i]) & _NOT_RANK_BEFORE)


# Names that say "this process is the one" (`is_main`, `rank0_only`, `on_leader`): flags,
# read by their truth. A name that only says "rank" (`rank`, `node_rank`, `gpu_id`) names a
# number, and only a number's comparison is a guard.
_FLAG_WORDS = ("main", "master", "primary", "chief", "zero", "rank0", "rank_0", "leader")


def _is_flag_word(word: str) -> bool:
    low = word.lower()
    return low.startswith(("is_", "on_")) or any(w in low for w in _FLAG_WORDS)


# The names of a rank number itself, which `if not rank:` tests as `rank == 0`.
_BARE_RANKS = {"rank", "local_rank", "global_rank", "node_rank", "world_rank", "rank_id", "gpu_id"}


def named_rank_counts(facts, node: ast.AST, word: str) -> bool:
    """Whether a name that is a rank by its words alone (no data flow made it one) may be
    read as a rank where it stands: a flag word (`is_main`) or a function (`get_rank()`)
    anywhere; the bare name of a rank number (`rank`, `local_rank`) anywhere; any other
    name with "rank" in it only where it is compared or computed with, as a number is
    (`self.src_rank == 0`, `% 8`). A setting whose name mentions ranks, tested for its
    truth (`if self.negatives_across_rank:`), is no rank. Names that are not rank words
    pass through."""
    if not (is_local_word(word) or is_guard_word(word)) or _is_flag_word(word) or word.lower() in _BARE_RANKS:
        return True
    parent = facts.parents.get(node)
    if isinstance(parent, ast.Call) and parent.func is node:
        return True
    return isinstance(parent, (ast.Compare, ast.BinOp))


# What a library defines as the rank or the main process (torch.distributed's getters,
# Accelerate's and Lightning's attributes): facts about the library, not guesses from a name.
_LIBRARY_RANKS = {
    "get_rank",
    "get_local_rank",
    "get_global_rank",
    "get_node_local_rank",
    "is_main_process",
    "is_local_main_process",
    "is_global_zero",
    "is_world_process_zero",
    "is_local_process_zero",
    "process_index",
    "local_process_index",
}


def named_only(facts, test: ast.AST) -> str | None:
    """The name a rank test rests on when nothing but its words make it one: no data flow
    reaches it, no library defines it, and it is not an attribute named as a rank number
    (`args.local_rank`, which launchers fill): `if rank == 0:`, `if self.peer_rank == 0:`
    or `if is_master:` with the value set out of view. None when the test is a rank test
    by data flow, by a library's rank, or by such an attribute."""
    first = None
    for n in ast.walk(test):
        word, name = _word(n), _ref(n)
        if name in facts.rank_variables or (isinstance(n, ast.Constant) and env_rank_kind(n.value)):
            return None
        if isinstance(n, ast.Call) and _word(n.func) in facts.project.rank_flag_functions:
            return None
        if word in _LIBRARY_RANKS or (isinstance(n, ast.Attribute) and (word or "").lower() in _BARE_RANKS):
            return None
        if (
            first is None
            and word
            and (is_local_word(word) or is_guard_word(word))
            and named_rank_counts(facts, n, word)
            and not word.lower().endswith("_only")
        ):
            first = _ref(n) or word
    return first
