"""Compatibility of a checkpoint with the state it is loaded into (P-CKPT-5), and
short descriptions of failures, so a user sees one clear message instead of a
200-line traceback from deep inside DCP.
"""

from __future__ import annotations

import errno
from pathlib import Path

import torch

from disttrain.checkpoint.checkpoint_errors import CheckpointMismatch
from disttrain.runtime import torch_compat

SHOW = 5


def check_compatible(
    tensors: dict, step_dir: Path, *, strict: bool = True, metadata=None, flat: dict | None = None
) -> None:
    """Compare the keys, global shapes and dtypes of `tensors` (the dict DCP will
    load into) with DCP's metadata in `step_dir`.

    `metadata`: DCP's metadata of `step_dir` when the caller read it already; `flat`:
    `tensors` flattened (`torch_compat.flatten_state_dict`), when the caller has it.
    Raises `CheckpointMismatch` listing the first few mismatches. Call only after
    the manifest verified: the `.metadata` of a checkpoint of the `dcp` storage format
    is a pickle.
    """
    # DCP is imported here, on a load, not when the trainer starts (it pulls in sympy)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from disttrain.checkpoint.storage_formats import read_metadata

    saved = (metadata if metadata is not None else read_metadata(step_dir)).state_dict_metadata
    flat = torch_compat.flatten_state_dict(tensors) if flat is None else flat
    problems = []
    for key, value in flat.items():
        if key not in saved:
            problems.append(f"missing from the checkpoint: {key}")
            continue
        meta = saved[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(meta, TensorStorageMetadata):
                problems.append(f"{key}: the checkpoint holds a non-tensor value")
            elif tuple(meta.size) != tuple(value.shape):
                problems.append(f"{key}: shape {tuple(meta.size)} in the checkpoint, {tuple(value.shape)} in the model")
            elif meta.properties.dtype != value.dtype:
                problems.append(f"{key}: dtype {meta.properties.dtype} in the checkpoint, {value.dtype} in the model")
    if strict:
        for key in saved:
            if key.startswith("model.") and key not in flat:
                problems.append(f"in the checkpoint but not in the model: {key}")
    if problems:
        listing = "\n  ".join(problems[:SHOW])
        more = f"\n  ... and {len(problems) - SHOW} more" if len(problems) > SHOW else ""
        fused = any(k.endswith("attn.qkv.weight") for k in saved) and any(k.endswith("attn.q.weight") for k in flat)
        hint = (
            "It holds the fused `attn.qkv` of the built-in GPT before its attention was split into "
            "`attn.q`, `attn.k` and `attn.v`: finish that run with the version that wrote it, or split "
            "each `attn.qkv` weight and bias into three equal row blocks (q, k, v) (CHANGELOG, Breaking).\n"
            if fused
            else ""
        )
        raise CheckpointMismatch(
            f"{step_dir} does not match the model/optimizer being loaded "
            f"({len(problems)} mismatches):\n  {listing}{more}\n{hint}"
            f"Load it into the model it was saved from (see `disttrain ckpt inspect "
            f"{step_dir}`), or start a fresh run in another checkpoint directory."
        )


def walk_causes(exc: BaseException):
    from torch.distributed.checkpoint.api import CheckpointException

    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, CheckpointException):
            stack += [pair[0] if isinstance(pair, tuple) else pair for pair in e.failures.values()]
        stack += [c for c in (e.__cause__, e.__context__) if c is not None]


def failed_ranks(exc: BaseException) -> list[int]:
    """The ranks whose failure a DCP `CheckpointException` carries (DCP gathers every
    rank's failure and raises it on all ranks), sorted; [] for any other error."""
    from torch.distributed.checkpoint.api import CheckpointException

    ranks: set[int] = set()
    for e in walk_causes(exc):
        if isinstance(e, CheckpointException):
            ranks.update(int(r) for r in e.failures)
    return sorted(ranks)


def describe_failure(exc: BaseException, rank: int) -> str:
    """'rank R: why' for a failed DCP save or load. DCP raises the failure of any rank
    on every rank, so R is the rank that failed (from DCP's failures), else `rank`."""
    ranks = failed_ranks(exc) or [rank]
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return f"{who}: {describe(exc)}"


def describe(exc: BaseException) -> str:
    """One line for any save/load failure: the root cause, ENOSPC named as disk full."""
    from torch.distributed.checkpoint.api import CheckpointException

    root = exc
    for e in walk_causes(exc):
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return f"disk full (ENOSPC: {e.strerror})"
        if not isinstance(e, CheckpointException):
            root = e
    text = str(root).strip().splitlines()
    return f"{type(root).__name__}: {text[-1] if text else ''}"[:400]
