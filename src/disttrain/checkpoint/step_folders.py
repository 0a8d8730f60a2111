"""The checkpoint root's folders on disk: names, manifest, verification, "latest", writer
fencing and retention (P-CKPT-2, P-CKPT-3, P-ELASTIC-5).

    ROOT/
      WRITER.json                    the writer lease: {run_id, generation}
      step-00001200/                 a committed checkpoint
        .metadata  __0_0.distcp ...  DCP's metadata (JSON) and each rank's data file
        state.json                   global non-tensor state (step, scheduler, ...)
        rank-00000.json ...          per-rank RNG state
        manifest.json                written last: size + checksum of every file
      .tmp-step-00001300-g3-1a2b3c/  being written; never read
      .corrupt-step-00001100-1a2b3c/ a damaged step directory moved aside by a re-save; kept

A checkpoint is committed by one `os.rename` of a finished temporary directory, so
a crash leaves either no `step-*` directory or a complete one. "Latest" is the
newest committed directory, by (writer generation, step); nothing else (no pointer
file) decides it. A damaged newest one is reported, never silently passed over
(the loader's `fallback` skips it with a warning naming it). Each job claims a generation one above
every generation seen; a writer whose lease was taken over refuses to commit, and
an older generation can never outrank a newer one, so a stale writer in a
split-brain cannot make its checkpoint "latest".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from disttrain import json_text
from disttrain.checkpoint.checkpoint_errors import CheckpointCorrupt, CheckpointUnsafe, StaleWriterError
from disttrain.checkpoint.digests import KNOWN, expected, file_mismatch
from disttrain.checkpoint.files import atomic_write_bytes, fsync_dir
from disttrain.checkpoint.own_files import SMALL_LIMIT, escape_message, escapes, name_problem, open_own, read_own
from disttrain.plain_files import MiB, NotPlainFile, read_plain
from disttrain.runtime.log import LOGGER

MANIFEST = "manifest.json"
LEASE = "WRITER.json"
LEASE_LIMIT = 1 * MiB  # the lease is two values: a larger one is no lease of ours
FORMAT = 1
_STEP_RE = re.compile(r"^step-(\d{8})$")
_STEP_IN = re.compile(r"step-\d{8}")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def tmp_name(step: int, generation: int, run_id: str) -> str:
    return f".tmp-{step_name(step)}-g{generation}-{run_id}"


def write_manifest(tmp_dir: Path, info: dict, files: dict[str, dict]) -> dict:
    """Write `manifest.json` last, atomically, from the digests the ranks computed
    while writing (`files`: {name: {"size", "digest"}}); no file is read back.

    `info` (step, world layout, strategy, versions, ...) is stored beside the file
    table. The directory must hold exactly the files in `files`, with their sizes:
    otherwise `CheckpointCorrupt` names the first difference. Raises `OSError`
    (ENOSPC included) if the manifest cannot be written.
    """
    present = {
        p.name: p.stat().st_size
        for p in tmp_dir.iterdir()
        if p.is_file() and p.name != MANIFEST and not p.name.startswith("." + MANIFEST)
    }
    for name in sorted(set(present) | set(files)):
        if name not in files:
            raise CheckpointCorrupt(f"{tmp_dir / name} was written but no rank reported its checksum.", name)
        if present.get(name) != files[name]["size"]:
            raise CheckpointCorrupt(
                f"{tmp_dir / name} has {present.get(name)} bytes on disk, its writer hashed {files[name]['size']}.",
                name,
            )
    manifest = {"format": FORMAT, **info, "files": dict(sorted(files.items()))}
    atomic_write_bytes(json.dumps(manifest, indent=1, sort_keys=True).encode(), tmp_dir / MANIFEST)
    return manifest


def read_manifest(step_dir: Path) -> dict:
    """The parsed manifest (JSON, never pickle). Raises `CheckpointCorrupt` naming it,
    or `CheckpointUnsafe` for a manifest that is a symlink, not a regular file, over
    `own_files.SMALL_LIMIT` bytes (each refused before it is read: `own_files.read_own`),
    or that names a file that is not a plain name in it (`name_problem`)."""
    path = step_dir / MANIFEST
    try:
        if escapes(step_dir, MANIFEST):
            raise CheckpointUnsafe(escape_message(step_dir, MANIFEST), MANIFEST)
        manifest = json_text.loads(read_own(step_dir, MANIFEST))
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        if not isinstance(manifest.get("files"), dict) or manifest.get("format") != FORMAT:
            raise ValueError("unknown format")
        if (wrong := _wrong_entry(manifest)) is not None:
            raise ValueError(wrong)
        for name in manifest["files"]:
            if (why := name_problem(name)) is not None:
                raise CheckpointUnsafe(
                    f"{path} names the file {name!r}, {why}: refused, nothing "
                    f"outside {step_dir} is read. A manifest lists plain names of "
                    f"files in its own folder; this one was altered.",
                    MANIFEST,
                )
        return manifest
    except FileNotFoundError:
        if is_empty_dir(step_dir):
            raise CheckpointCorrupt(
                f"{step_dir} is an empty folder, not a checkpoint (a commit renames a "
                f"complete folder into place, so disttrain never leaves one empty); "
                f"remove it with rmdir.",
                MANIFEST,
            ) from None
        raise CheckpointCorrupt(f"{step_dir}: no {MANIFEST}; the commit is incomplete.", MANIFEST) from None
    except (ValueError, OSError) as e:
        raise CheckpointCorrupt(f"{path} is unreadable ({e}); the checkpoint is damaged.", MANIFEST) from None


def count(value) -> bool:
    """True for a whole number >= 0 (not a bool): a size, a step, a generation."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _wrong_entry(manifest: dict) -> str | None:
    """What is not of its type in `manifest` (a file record that is not {size, digest},
    a step, generation, world size or tensor-parallel degree that is not a count, a
    degree that does not divide the world), or None."""
    for key in ("step", "generation", "world_size", "epoch", "tp"):
        if key in manifest and not count(manifest[key]):
            return f"its {key} is {str(manifest[key])[:40]!r}, not a whole number >= 0"
    tp, world = manifest.get("tp", 1), manifest.get("world_size", 1)
    if not tp or world % tp:
        return f"its tensor-parallel degree tp {tp} does not divide its world size {world}"
    for name, want in manifest["files"].items():
        digest = want.get("digest", want.get("sha256")) if isinstance(want, dict) else None
        if not isinstance(want, dict) or not count(want.get("size")) or not isinstance(digest, str):
            return f"the record of {str(name)[:80]!r} is not {{size, digest}}"
        if (algorithm := expected(want)[0]) not in KNOWN:
            return (
                f"the record of {str(name)[:80]!r} names the digest {algorithm[:40]!r}, not one of {', '.join(KNOWN)}"
            )
    return None


def verify(step_dir: str | os.PathLike, *, checksums: bool = True, select: Callable[[str], bool] | None = None) -> dict:
    """Check that every file in the manifest exists with its size and checksum, that
    DCP's `.metadata` is among them, and that no unlisted shard is present.

    Returns the manifest. Raises `CheckpointCorrupt` naming the first bad file, or
    `CheckpointUnsafe` for a file name or a symlink that leaves `step_dir`: the
    names are checked, and a symlink out refused, before any file is read.
    `checksums=False` checks existence and sizes only (cheap; used by retention).
    `select(name)` limits the hashing to the files it accepts (a load hashes most
    files as DCP reads them); sizes are still checked for all of them.
    """
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        raise CheckpointCorrupt(f"{step_dir} is not a checkpoint directory.", "")
    manifest = read_manifest(step_dir)
    if (wrong := misnamed(step_dir, manifest)) is not None:
        raise CheckpointCorrupt(wrong, MANIFEST)
    files = manifest["files"]
    if ".metadata" not in files:
        raise CheckpointCorrupt(f"{step_dir}: the manifest lists no .metadata.", ".metadata")
    for name in sorted(files):
        if escapes(step_dir, name):
            raise CheckpointUnsafe(escape_message(step_dir, name), name)
    for name, want in sorted(files.items()):
        _check_file(step_dir, name, want, checksums and (select is None or select(name)))
    for path in step_dir.iterdir():
        if path.suffix == ".distcp" and path.name not in files:
            raise CheckpointCorrupt(f"{path} is not in the manifest (a foreign shard).", path.name)
    return manifest


def _check_file(step_dir: Path, name: str, want: dict, hashed: bool) -> None:
    """Check the file `name` of `step_dir` against its manifest record `want` on one
    open descriptor (`own_files.open_own`: a regular file, no symlink followed, its
    size), and with `hashed` its digest from that descriptor."""
    path = step_dir / name
    try:
        with open_own(step_dir, name, want) as f:
            if hashed and (bad := file_mismatch(f, want, path)):
                raise CheckpointCorrupt(bad, name)
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{path} is missing (listed in the manifest).", name) from None
    except OSError as e:
        raise CheckpointCorrupt(f"{path} cannot be read ({e.strerror or e}).", name) from None


def is_empty_dir(path: Path) -> bool:
    try:
        return path.is_dir() and not any(path.iterdir())
    except OSError:
        return False


def misnamed(step_dir: Path, manifest: dict) -> str | None:
    """Why `step_dir` is not the checkpoint its name says (its manifest records another
    step: a copy or a rename), or None. The manifest, not the folder name, says which
    step a checkpoint holds; a folder under a false name is never trusted."""
    m = _STEP_RE.match(step_dir.name)
    step = manifest.get("step")
    if m is None or not isinstance(step, int) or isinstance(step, bool) or step == int(m.group(1)):
        return None
    return (
        f"{step_dir} holds step {step} by its manifest (run {manifest.get('run_id')!r}, generation "
        f"{manifest.get('generation')}), not step {int(m.group(1))}: the folder was copied or renamed. "
        f"It is not trusted; move it out of {step_dir.parent}, or name it {step_name(step)}."
    )


def _manifest_or_none(step_dir: Path) -> dict | None:
    """The manifest of `step_dir` as a dict, or None when it cannot be read: missing,
    truncated, not JSON, or refused before it is read (a symlink, a FIFO, a device,
    over `own_files.SMALL_LIMIT` bytes: `plain_files.read_plain`), so listing a root
    never hangs or fills memory on one such folder."""
    try:
        manifest = json_text.loads(read_plain(step_dir / MANIFEST, SMALL_LIMIT))
        return manifest if isinstance(manifest, dict) else None
    except (OSError, ValueError, NotPlainFile):
        return None


def manifest_owner(step_dir: Path) -> tuple[str, int] | None:
    """(run_id, generation) from the manifest of `step_dir`, or None when it cannot be
    read (`_manifest_or_none`)."""
    try:
        manifest = _manifest_or_none(step_dir)
        return None if manifest is None else (str(manifest.get("run_id", "")), int(manifest.get("generation", 0)))
    except (ValueError, TypeError, OverflowError):
        return None


def _identity(step_dir: Path, name_step: int) -> tuple[int | None, int]:
    """(generation, step) by which `step_dir` ranks: both from its manifest; the folder
    name's step (and no generation) when the manifest cannot be read."""
    manifest = _manifest_or_none(step_dir)
    owner = manifest_owner(step_dir) if manifest is not None else None
    if owner is None or manifest is None:
        return None, name_step
    step = manifest.get("step")
    return owner[1], step if isinstance(step, int) and not isinstance(step, bool) else name_step


def committed(root: str | os.PathLike) -> list[tuple[int, int, Path]]:
    """(generation, step, dir) of every committed step directory, newest first.

    The generation and step come from each directory's manifest (a copy of step 2
    under the name step-10 ranks as step 2; loading or verifying it fails, naming
    it). A directory whose manifest cannot be read has no known generation: it ranks
    by its name's step within the newest generation seen, so a damaged newest
    checkpoint is still the newest (loading it fails, naming it) instead of being
    silently passed over for an older one. An empty `step-*` folder holds nothing and
    is no checkpoint: it is not listed (`empty_step_dirs` names them)."""
    root = Path(root)
    found = []
    if not root.is_dir():
        return []
    for path in root.iterdir():
        m = _STEP_RE.match(path.name)
        if m and path.is_dir() and not is_empty_dir(path):
            generation, step = _identity(path, int(m.group(1)))
            found.append((generation, step, path))
    newest = max((g for g, _, _ in found if g is not None), default=0)
    out = [(newest if g is None else g, step, path) for g, step, path in found]
    return sorted(out, key=lambda t: (t[0], t[1]), reverse=True)


def empty_step_dirs(root: str | os.PathLike) -> list[Path]:
    """The empty `step-*` folders under `root`, which `committed` does not list."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _STEP_RE.match(p.name) and is_empty_dir(p))


def note_empty_step_dirs(root: str | os.PathLike, rank: int = 0) -> None:
    """On rank 0, one note per empty `step-*` folder under `root` (which `committed` skips)."""
    for empty in empty_step_dirs(root) if rank == 0 else []:
        LOGGER.info(
            f"disttrain checkpoint: note: {empty} is an empty folder, not a checkpoint; it is "
            f"ignored (remove it with rmdir)."
        )


def latest_valid(root: str | os.PathLike, *, checksums: bool = True) -> Path | None:
    """The newest committed directory that verifies, or None."""
    for _, _, path in committed(root):
        try:
            verify(path, checksums=checksums)
            return path
        except CheckpointCorrupt:
            continue
    return None


# ---------------------------------------------------------------- writer fencing


def read_lease(root: Path) -> dict:
    """The writer lease of `root`; no lease (generation 0) when it is missing, not
    JSON, or refused before it is read (`plain_files.read_plain`: a symlink, not a
    regular file, over `LEASE_LIMIT` bytes) or not a lease (a run id and a generation).
    Taking the lease replaces it."""
    try:
        lease = json_text.loads(read_plain(root / LEASE, LEASE_LIMIT))
        if isinstance(lease, dict) and isinstance(lease.get("run_id"), str) and count(lease.get("generation")):
            return lease
        return {"run_id": "", "generation": 0}  # not a lease of ours: as good as none
    except (OSError, ValueError, NotPlainFile):
        return {"run_id": "", "generation": 0}


def claim_generation(root: Path, run_id: str) -> int:
    """Take the writer lease: generation = 1 + the highest seen in the lease or any
    manifest. Call on one rank only. Returns the new generation."""
    root.mkdir(parents=True, exist_ok=True)
    seen = [read_lease(root).get("generation", 0)] + [g for g, _, _ in committed(root)]
    generation = max(seen) + 1
    atomic_write_bytes(json.dumps({"run_id": run_id, "generation": generation}).encode(), root / LEASE)
    return generation


def check_fence(root: Path, run_id: str, generation: int) -> None:
    """Raise `StaleWriterError` unless this writer still holds the lease."""
    lease = read_lease(root)
    if lease.get("run_id") != run_id or lease.get("generation") != generation:
        raise StaleWriterError(
            f"{root}: another job (run {lease.get('run_id')!r}, generation "
            f"{lease.get('generation')}) took over this checkpoint directory; this writer "
            f"(run {run_id!r}, generation {generation}) is stale and does not commit. "
            f"Stop this job: two jobs must never train into one directory."
        )


def committed_by(final: Path, run_id: str, generation: int) -> bool:
    """True when `final` is a committed checkpoint of this writer (run id and
    generation) that still passes the cheap size check: re-saving it is a no-op."""
    if manifest_owner(final) != (run_id, generation):
        return False
    try:
        verify(final, checksums=False)
        return True
    except CheckpointCorrupt:
        return False


def _aside_name(root: Path, base: str) -> Path:
    """`root/base`, or `root/base-2`, `-3`, ...: a name no kept directory has yet."""
    path, n = root / base, 1
    while os.path.lexists(path):
        n += 1
        path = root / f"{base}-{n}"
    return path


def commit(tmp_dir: Path, final: Path, run_id: str, generation: int) -> None:
    """Atomically publish `tmp_dir` as `final` (rank 0 only).

    Raises `StaleWriterError` when this writer no longer holds the lease (it was
    fenced), or when `final` belongs to another writer of this or a newer
    generation. An existing, intact `final` of an older generation (an abandoned
    timeline after a resume from an earlier step), or this writer's own, is moved
    aside first and pruned. A damaged one (its manifest unreadable, or a file failing
    its size or checksum: the one a `fallback` load skipped) is moved to
    `.corrupt-step-N-...` and kept for inspection, never deleted. Never writes into
    an existing step directory.
    """
    root = final.parent
    check_fence(root, run_id, generation)
    _private(tmp_dir)
    if final.exists():
        owner = manifest_owner(final)
        if owner is not None and owner[1] >= generation and owner != (run_id, generation):
            raise StaleWriterError(
                f"{final} was already committed by run {owner[0]!r}, generation {owner[1]}; "
                f"this writer (run {run_id!r}, generation {generation}) is stale and does not "
                f"overwrite it. Stop this job: two jobs must never train into one directory."
            )
        try:
            if owner is None:
                raise CheckpointCorrupt("unreadable manifest")
            verify(final)
            aside = root / f".replaced-{final.name}-g{owner[1]}-{run_id}"
            shutil.rmtree(aside, ignore_errors=True)
        except CheckpointCorrupt:
            aside = _aside_name(root, f".corrupt-{final.name}-{run_id}")
        os.rename(final, aside)
    os.rename(tmp_dir, final)  # the commit: atomic on one filesystem
    fsync_dir(root)


def _private(tmp_dir: Path) -> None:
    """Every file of the checkpoint readable by its owner only, as its manifest and
    `state.json` are written: DCP writes its shards and `.metadata` with the process's
    umask (0644 by default), which let other users on the machine read the weights."""
    for entry in os.scandir(tmp_dir):
        if entry.is_file(follow_symlinks=False):
            os.chmod(entry.path, 0o600)


# ---------------------------------------------------------------- retention


def prune(
    root: Path,
    keep_last: int,
    generation: int,
    remove: Callable[[Path], object] = lambda p: shutil.rmtree(p, ignore_errors=True),
) -> list[Path]:
    """Delete committed directories beyond the newest `keep_last` valid ones, leftover
    temporary directories of older generations, and replaced directories.

    Call only right after a commit. Never deleted: the newest valid (size-checked)
    checkpoint whose manifest does not mark its weights non-finite, even when
    `keep_last` newer ones (say NaN ones) exist; a corrupt directory newer than the
    kept ones; any directory whose manifest cannot be read (its age is unknown) or
    names another step than its folder (a copy: not this run's to delete).
    `keep_last <= 0` keeps everything. Returns the deleted paths.

    Each one is first renamed to a `.replaced-` name (the next prune deletes any
    such name), so it is gone from every listing at once; then `remove(new path)`
    deletes it: unlinking a large checkpoint's files takes a while, and a caller may
    do it on another thread.
    """
    deleted = []
    if keep_last > 0:
        kept, anchored = 0, False  # anchored: the newest valid, finite one is kept
        for _, _, path in committed(root):
            manifest = _manifest_or_none(path)
            if manifest is None or manifest_owner(path) is None or misnamed(path, manifest):
                continue
            try:
                verify(path, checksums=False)
                valid = True
            except CheckpointCorrupt:
                valid = False
            finite = manifest.get("finite") is not False  # older manifests do not say
            if kept < keep_last:
                kept += valid
                anchored = anchored or (valid and finite)
                continue
            if valid and finite and not anchored:
                anchored = True
                continue
            deleted.append(path)
    for path in root.iterdir():
        m = re.match(r"^\.(tmp|replaced)-step-\d{8}-g(-?\d+)-", path.name)
        if m and (m.group(1) == "replaced" or int(m.group(2)) < generation):
            deleted.append(path)
    for path in deleted:
        aside = path
        if not path.name.startswith(".replaced-"):
            named = _STEP_IN.search(path.name)  # (every path here is named by its step)
            step = named.group(0) if named else path.name
            aside = root / f".replaced-{step}-g{generation}-{uuid.uuid4().hex[:8]}"
            try:
                path.rename(aside)
            except OSError:
                aside = path
        remove(aside)
    return deleted
