"""The verified load of a checkpoint in either storage format (`storage_formats`):
each file of this rank's share hashed as it is read, checked before it is parsed.
Imported when a checkpoint is read, so DCP stays out of start-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from disttrain.checkpoint.checkpoint_errors import CheckpointCorrupt, CheckpointUnsafe
from disttrain.checkpoint.load_phases import phase

if TYPE_CHECKING:
    from torch.distributed.checkpoint import LoadPlanner, StorageReader

    from disttrain.checkpoint.dcp_read import VerifyingFileSystem
    from disttrain.checkpoint.raw_storage import RawReader

UNSAFE = "unsafe"
"""The kind of a problem ("", UNSAFE, message) that refuses the folder (`CheckpointUnsafe`)."""
PROBLEM = tuple[str, str] | tuple[str, str, str] | None
"""A rank's problem with a load: None, (bad file, message), or ("", kind, message)."""


def load_verified(
    tensors: dict,
    step_dir: Path,
    files: dict[str, dict],
    pg,
    select=lambda name: True,
    storage: str = "dcp",
    metadata=None,
    flat: tuple[dict, dict] | None = None,
) -> tuple[tuple | None, set[str]]:
    """DCP-load `tensors` in place from `step_dir` (in the storage format `storage`;
    `metadata`: its DCP metadata, when read already), each file `select` accepts read
    once and checked against `files` (the manifest's records) before its values are
    parsed. Never raises: a failure is returned, for the caller to agree on.
    `flat`: `torch_compat.flatten_with_paths(tensors)`, when the caller has it: a
    `raw-1` load whose plan needs no planning (`direct_load`) then reads it without
    DCP's planner.

    Returns (problem, the names this rank checked). `problem` is None, (bad file,
    message) for a file that failed its check, ("", UNSAFE, message) for a folder
    refused (`CheckpointUnsafe`), or ("", "", message) for any other failure of DCP
    (one line, the root cause). The format `raw-1` loads without a
    collective (`no_dist`: each rank's reads depend on its own state and the metadata
    only), so `problem` is this rank's own; DCP's default format gathers every rank's
    failure, so there it is the same on every rank. The tensors may be partly
    overwritten after a problem: load them again before use.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from disttrain.checkpoint import raw_storage
    from disttrain.checkpoint.compat import describe, walk_causes
    from disttrain.checkpoint.direct_load import DirectPlanner, direct_plan

    raw = storage == raw_storage.FORMAT
    reader: StorageReader
    planner: LoadPlanner | None
    checked: RawReader | VerifyingFileSystem
    with phase("plan"):
        plan = direct_plan(flat[0], metadata) if raw and flat is not None and metadata is not None else None
    if raw:
        reader = raw_storage.RawReader(step_dir, files, select, metadata)
        planner, checked = raw_storage.JsonLoadPlanner(), reader
    else:
        from disttrain.checkpoint.dcp_read import SafeReader, VerifyingFileSystem  # here: the first format only

        safe = SafeReader(str(step_dir), metadata)
        planner, checked = None, VerifyingFileSystem(step_dir, files, select)
        safe.fs = checked
        reader = safe
    try:
        with phase("reads"):
            if plan is not None and flat is not None:  # DCP's own plan, known without planning: read it
                reader.read_data(plan, DirectPlanner(tensors, *flat)).wait()
            else:
                dcp.load(tensors, storage_reader=reader, planner=planner, process_group=pg, no_dist=raw)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        bad = [c for c in walk_causes(e) if isinstance(c, CheckpointCorrupt)]
        if bad:
            first = min(bad, key=lambda c: (not isinstance(c, CheckpointUnsafe), c.bad_file, str(c)))
            return as_problem(first), checked.verified
        return ("", "", f"{step_dir} could not be loaded: {describe(e)}"), checked.verified
    return None, checked.verified


def as_problem(e: CheckpointCorrupt) -> tuple:
    """`e` as a problem to agree on: (bad file, message) for a damaged file, which a
    fallback may skip; ("", UNSAFE, message) for a refused folder, which none skips."""
    return ("", UNSAFE, str(e)) if isinstance(e, CheckpointUnsafe) else (e.bad_file, str(e))


def raise_agreed(verdict: tuple, other: type) -> None:
    """Raise the verdict ("", kind, message) of `agree` on every rank: `CheckpointUnsafe`
    for a refused folder, else `other`."""
    raise (CheckpointUnsafe if verdict[1] == UNSAFE else other)(verdict[2])


def check_files(step_dir: Path, select) -> tuple | None:
    """This rank's check of all sizes and the hashes of the files `select` accepts:
    None, or the problem of the first bad file (`as_problem`)."""
    from disttrain.checkpoint import step_folders

    try:
        step_folders.verify(step_dir, select=select)
    except CheckpointCorrupt as e:
        return as_problem(e)
    return None


def agree(gathered: list) -> tuple | None:
    """The one verdict from every rank's own (the list an all-gather returned): None,
    (bad file, message), or ("", kind, message) for another failure. A refused folder
    outranks everything (no fallback may skip it), then a damaged file (it is what a
    fallback skips); the least by name."""
    found = [f for f in gathered if f]
    unsafe = [f for f in found if len(f) == 3 and f[1] == UNSAFE]
    return min(unsafe or [f for f in found if len(f) == 2] or found) if found else None


def problems(mine, pg, gather) -> list:
    """Every rank's problem (`gather(value, shape)`: an all-gather of one JSON value
    per rank, checked against `PROBLEM`), or [] when no rank has one: one all-reduce of
    a flag decides that first. A problem is rare, and the all-gather is two
    collectives of padded texts."""
    if pg is None:
        return gather(mine, PROBLEM)
    flag = torch.tensor([mine is not None], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pg)
    return gather(mine, PROBLEM) if flag.item() else []


def load_one(step_dir: Path, tensors: dict, strict: bool, rank: int, world: int, pg, gather) -> str | None:
    """A collective: load `step_dir` into `tensors`, every file checked once;
    returns None or the first bad file's message, the same on every rank (`gather`:
    the checkpointer's all-gather of one JSON value per rank, `problems`).

    Before anything is parsed every rank hashes the small files it parses itself
    (`.metadata`, `state.json`, its RNG file) and compares keys and shapes; the data
    files are checked as they are read, each by the rank of its share
    (`digests.share`, `load_verified`); then each rank hashes the files of its share
    it did not read. Two agreements (`problems`) settle the outcome. Raises
    `CheckpointMismatch` (another model), `CheckpointUnsafe` (a refused folder: a
    foreign class in a pickle, a file outside it) or `CheckpointCorrupt` (a failure
    that is no damaged file) on every rank."""
    from disttrain.checkpoint.raw_read import prefetch_share, stop_for

    first = {".metadata", "state.json", f"rank-{rank:05d}.json"}
    with phase("small files"):
        mine = check_files(step_dir, first.__contains__)
    if mine is None:
        # the share streams from the disk while the load plans; only now, as the small
        # files read cold behind that stream took longer than the stream saved
        prefetch_share(step_dir, rank, world)
    try:
        return _load_checked(step_dir, tensors, strict, rank, world, pg, gather, first, mine)
    finally:
        stop_for(step_dir)  # on every way out: DCP's format, another rank's problem, an error


def _load_checked(
    step_dir: Path, tensors: dict, strict: bool, rank: int, world: int, pg, gather, first: set[str], mine: tuple | None
) -> str | None:
    """`load_one` once this rank checked its small files `first` (`mine`: None or
    its problem)."""
    from disttrain.checkpoint import step_folders
    from disttrain.checkpoint.checkpoint_errors import CheckpointMismatch
    from disttrain.checkpoint.compat import check_compatible
    from disttrain.checkpoint.digests import share
    from disttrain.checkpoint.storage_formats import read_metadata
    from disttrain.runtime.torch_compat import flatten_with_paths

    metadata, flat = None, flatten_with_paths(tensors)  # once, for the check and the plan
    if mine is None:
        try:
            with phase("metadata"):
                metadata = read_metadata(step_dir)
                check_compatible(tensors, step_dir, strict=strict, metadata=metadata, flat=flat[0])
        except CheckpointMismatch as e:
            mine = ("", "", str(e))
        except CheckpointCorrupt as e:
            mine = as_problem(e)
    with phase("agree"):
        verdict = agree(problems(mine, pg, gather))
    if verdict is not None:
        if len(verdict) == 3:
            raise_agreed(verdict, CheckpointMismatch)  # the same message on every rank
        return verdict[1]
    ours = lambda n: share(n, world) == rank  # noqa: E731
    with phase("small files"):
        manifest = step_folders.read_manifest(step_dir)
    problem, read = load_verified(
        tensors, step_dir, manifest["files"], pg, ours, manifest.get("storage", "dcp"), metadata, flat
    )
    done = first | read
    if problem is None:
        with phase("share check"):
            problem = check_files(step_dir, lambda n: n not in done and ours(n))
    with phase("agree"):
        verdict = agree(problems(problem, pg, gather))
    if verdict is not None and len(verdict) == 3:
        raise_agreed(verdict, CheckpointCorrupt)  # not a damaged file: no fallback
    return verdict[1] if verdict else None
