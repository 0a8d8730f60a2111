"""Save and load complete, atomic, verified checkpoints with DCP (P-CKPT-1..5,
P-FSDP-8): the orchestration across ranks.

Save, on every rank: write this rank's RNG file (rank 0: `state.json`) and DCP shards
into the temporary directory, hashing the bytes on their way to disk (`digests`);
agree (one all-gather of errors and digests) that every rank succeeded; then rank 0
writes the manifest last (no file read back), checks its writer lease and commits by
rename. The outcome is broadcast, so a failure anywhere raises the same
`CheckpointSaveError` on every rank and the previous checkpoint stays latest.

Async (`async_mode="thread"`): DCP's `async_save` copies the state to CPU memory
before it returns (training may then change the parameters), and writes on a
thread. It runs on the checkpointer's own gloo group: on the default group its
collectives interleave with training's and hang or abort. At most one save is in
flight: the next `load` or `wait` first completes it and raises its error; the next
`save` completes it, still performs (and completes) its own save, then raises it.
A `StaleWriterError` (this writer was fenced) is never a `CheckpointSaveError`.
The process-based mode of torch 2.13 is not offered (see docs/checkpoints.md).

Load: rank 0 lists the committed directories, newest first; each file is read
once and checked before it is parsed (`hashing_fs.load_one`), and the ranks agree on
the outcome, so a damaged file of any rank fails the load on every rank with one
message; a bad one is refused unless `fallback=True`. Keys and shapes are compared
with DCP's metadata, then DCP loads in place, resharding to the current strategy
and world size.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from disttrain import json_text
from disttrain.checkpoint import load_phases, step_folders
from disttrain.checkpoint.checkpoint_errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointSaveError,
    StaleWriterError,
)
from disttrain.checkpoint.compat import describe, describe_failure
from disttrain.checkpoint.digests import digest_bytes
from disttrain.checkpoint.files import atomic_write_bytes
from disttrain.checkpoint.own_files import read_own
from disttrain.checkpoint.state import TrainState, config_hash, param_fqns, set_rng_state, strategy_of, tp_degree
from disttrain.runtime import processes, rank_info
from disttrain.runtime.collectives import all_gather_json, broadcast_json
from disttrain.runtime.log import LOGGER

# DCP (torch.distributed.checkpoint) pulls in DTensor and sympy, about half a second:
# it is imported on the first save or load, not when the trainer starts.
ASYNC_MODES = ("off", "thread")
RAW_FORMAT = "raw-1"  # raw_storage.FORMAT, named here so the manifest needs no DCP import


_OUTCOME = tuple[str | None, dict[str, dict[str, int | str]], bool]
"""What each rank says of its part of a save: its failure or None, the manifest record
({"size", "digest"}) of each file it wrote, whether the weights it wrote are finite."""


def _failures() -> tuple:
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)  # DCP's CheckpointException is a BaseException


# DCP warns on each save and load of one process that it assumes one process: noise here.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
)


class Checkpointer:
    """Periodic checkpoints of one run in `root`: `save`, `load`, `wait`, `close`.

    Each checkpoint is a folder `root/step-NNNNNNNN` written under a temporary name
    and committed by a rename after every rank's files and the manifest (checksums)
    are on disk, so a kill at any moment leaves the previous checkpoint intact.
    Construction is a collective (it creates the checkpoint gloo group): every rank
    must build it. An unknown `async_mode` is a `CheckpointError` (a `UserError`).

    Args:
        root: The folder that holds the run's checkpoints.
        keep_last: Committed checkpoints to keep; older ones are removed after a
            commit (0 keeps all).
        async_mode: 'off' (`save` returns once committed) or 'thread' (`save` returns
            once the state is copied; the commit completes in the background).
        fallback: On load, set a damaged newest checkpoint aside and load the one
            before it, instead of refusing to start.
    """

    def __init__(self, root: str | Path, *, keep_last: int = 3, async_mode: str = "off", fallback: bool = False):
        if async_mode not in ASYNC_MODES:
            raise CheckpointError(
                f"checkpoint async mode {async_mode!r} is not offered; choose one "
                f"of {', '.join(ASYNC_MODES)} (the process mode is not proven "
                f"bit-exact in torch {torch.__version__.split('+')[0]})."
            )
        self.root, self.keep_last = Path(root), keep_last
        self.async_mode, self.fallback = async_mode, fallback
        info = rank_info()
        self.rank, self.world = info.rank, info.world_size
        self.pg = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.run_id = self._bcast(uuid.uuid4().hex[:8], str)
        self.generation: int | None = None
        self._inflight: Future | None = None
        from disttrain.checkpoint.async_part import AsyncStaging

        self._async = AsyncStaging()
        processes.freeze_long_lived()  # DCP's imports (sympy, DTensor) live as long as the rank
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="disttrain-ckpt")
        self._remover = ThreadPoolExecutor(max_workers=1, thread_name_prefix="disttrain-prune")
        # small files' fsyncs, two at once (the journal commits them together), off the save's path
        self._syncer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="disttrain-fsync")
        self._removals: list[Future] = []
        self.last_saved: Path | None = None
        self.last_load_phases: dict[str, float] = {}

    # ------------------------------------------------------------ collectives

    def _bcast(self, obj, shape):
        """Rank 0's `obj` on every rank, as JSON of `shape` (`broadcast_json`, `conform`:
        a tuple comes back a tuple). Raises `MalformedPeerValue` on a value of another
        shape: nothing a peer sends is unpickled."""
        if self.pg is None:
            return obj
        return broadcast_json(obj, src=0, group=self.pg, shape=shape)

    def _gather(self, obj, shape) -> list:
        """Every rank's `obj`, in rank order, as JSON of `shape` (`all_gather_json`),
        checked as `_bcast` checks."""
        if self.pg is None:
            return [obj]
        return all_gather_json(obj, group=self.pg, shape=shape)

    # ------------------------------------------------------------ save

    def save(self, state: TrainState) -> Path | None:
        """Checkpoint `state` as `ROOT/step-{state.step:08d}`. A collective.

        Sync mode returns the committed directory. Async mode returns None once the
        state is copied; the commit completes in the background. Re-saving a step
        this writer already committed is a no-op that returns that directory.

        Raises, on every rank: `CheckpointSaveError` when this save failed (the
        previous checkpoint then stays latest and intact); `StaleWriterError` (not a
        `CheckpointSaveError`) when another job took the directory over. When the
        previous async save failed, this save is still performed and completed
        first, then the earlier failure is raised as a `CheckpointSaveError` that
        says which checkpoint is now the latest.
        """
        earlier = self._settle()
        try:
            result = self._save_now(state)
            if earlier is not None and result is None:
                result = self.wait()  # commit this one before reporting the earlier failure
        except CheckpointSaveError as e:
            if earlier is None:
                raise
            raise CheckpointSaveError(f"{getattr(earlier, 'head', earlier)} Then: {e}") from None
        if earlier is not None:
            latest = result.name if result is not None else "it"  # (a Path: the save completed)
            raise CheckpointSaveError(
                f"{getattr(earlier, 'head', earlier)} The next save did commit: {latest} is now the latest checkpoint."
            ) from None
        return result

    def _settle(self) -> CheckpointSaveError | None:
        """Complete the in-flight async save; return its `CheckpointSaveError` instead
        of raising it (a `StaleWriterError` is raised: a fenced writer stops)."""
        try:
            self.wait()
        except CheckpointSaveError as e:  # a StaleWriterError is none: it propagates
            return e
        return None

    def _save_now(self, state: TrainState) -> Path | None:
        step = state.step
        if self.generation is None:
            self.generation = self._bcast(
                step_folders.claim_generation(self.root, self.run_id) if self.rank == 0 else None, int
            )
        tmp = self.root / step_folders.tmp_name(step, self.generation, self.run_id)
        final = self.root / step_folders.step_name(step)
        err, done = None, False
        if self.rank == 0:
            try:
                if step_folders.committed_by(final, self.run_id, self.generation):
                    step_folders.check_fence(self.root, self.run_id, self.generation)
                    done = True  # the same live writer saved this step already
                else:
                    shutil.rmtree(tmp, ignore_errors=True)
                    tmp.mkdir(parents=True)
            except StaleWriterError as e:
                err = f"stale writer: {e}"
            except OSError as e:
                err = f"cannot create {tmp}: {describe(e)}"
        err, done = self._bcast((err, done), tuple[str | None, bool])
        self._raise_if(err, step, tmp)
        if done:
            self.last_saved = final
            return final
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        from disttrain.checkpoint.fault_points import shard_filesystem
        from disttrain.checkpoint.raw_storage import JsonSavePlanner, RawWriter

        sd = state.state_dict()
        info = self._manifest_info(state, sd)
        # hashes and fsyncs each file (`.metadata`'s fsync on the sync thread, joined in _finish)
        local, writer = None, RawWriter(tmp, shard_filesystem(self.rank, step), syncer=self._syncer)
        small = self._write_small(tmp, sd, writer.digests)
        if self.async_mode == "off":
            try:
                dcp.save(
                    sd["tensors"], storage_writer=writer, planner=JsonSavePlanner(self.run_id), process_group=self.pg
                )
            except _failures() as e:
                local = describe_failure(e, self.rank)
            return self._finish(step, tmp, final, small, info, local, writer)
        part, planner = self._async.part(sd["tensors"]), JsonSavePlanner(self.run_id)
        try:
            future = dcp.async_save(
                part,
                storage_writer=writer,
                planner=planner,
                process_group=self.pg,
                async_stager=self._async.stager(),
                async_checkpointer_type=AsyncCheckpointerType.THREAD,
            )
        except BaseException:
            self._written(small + writer.pending)  # nothing writes into the directory once this raises
            raise
        self._inflight = self._pool.submit(self._complete, future, step, tmp, final, small, info, writer, planner)
        return None

    def _write_small(self, tmp: Path, sd: dict, digests: dict) -> list[Future]:
        """Write this rank's RNG file (rank 0: and `state.json`), each fsynced on the sync
        thread while DCP writes the data; their digests (from memory) go to `digests`.
        `_finish` joins them (`_written`) before the ranks agree."""
        files = {f"rank-{self.rank:05d}.json": json.dumps(sd["rng"]).encode()}
        if self.rank == 0:
            files["state.json"] = json.dumps(sd["meta"]).encode()
        for name, data in files.items():
            digests[name] = digest_bytes(data)
        return [self._syncer.submit(atomic_write_bytes, data, tmp / name) for name, data in files.items()]

    def _written(self, small: list[Future]) -> str | None:
        """Wait for `_write_small`'s files: None, or this rank's failure as one line."""
        first = next((e for e in [f.exception() for f in small] if e is not None), None)
        return None if first is None else f"rank {self.rank}: {describe(first)}"

    def _complete(self, future, step, tmp, final, small, info, writer, planner) -> Path:
        local = None
        try:
            future.result()
            self._async.learn(planner)
        except _failures() as e:
            local = describe_failure(e, self.rank)
        return self._finish(step, tmp, final, small, info, local, writer)

    def _finish(
        self, step: int, tmp: Path, final: Path, small: list[Future], info: dict, local: str | None, writer
    ) -> Path:
        from disttrain.checkpoint.fault_points import fault_point

        local = self._written(small) or local  # every file of this rank is on disk, or the save fails
        # one all-gather: each rank's outcome, digests, and whether the weights it wrote are finite
        digests, finite = writer.digests, writer.finite.all() if local is None else True
        gathered = self._gather((local, digests if local is None else {}, finite), _OUTCOME)
        err = next((e for e, _, _ in gathered if e), None)
        fault_point("after_shards", self.rank, step)
        if self.rank == 0 and err is None:
            assert self.generation is not None, "claimed by _save_now before any write"
            try:
                info = {**info, "finite": all(f for _, _, f in gathered)}
                files = {name: d for _, part, _ in gathered for name, d in part.items()}
                step_folders.write_manifest(tmp, info, files)
                for synced in writer.pending:  # `.metadata`, fsynced while the manifest was written
                    synced.result()
                fault_point("during_commit", self.rank, step)
                step_folders.commit(tmp, final, self.run_id, self.generation)
                self._join_removals()
                step_folders.prune(self.root, self.keep_last, self.generation, remove=self._remove_later)
            except StaleWriterError as e:
                err = f"stale writer: {e}"
            except (OSError, CheckpointError) as e:
                err = str(e) if isinstance(e, CheckpointError) else f"rank 0: {describe(e)}"
        self._written(writer.pending)  # nothing writes into the directory after this
        self._raise_if(self._bcast(err, str | None), step, tmp)
        self.last_saved = final
        return final

    def _raise_if(self, err: str | None, step: int, tmp: Path) -> None:
        if err is None:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if self.pg is not None:  # every rank sees the cleaned directory once it raises
            dist.barrier(group=self.pg)
        prev = step_folders.latest_valid(self.root, checksums=False)
        keep = f"{prev.name} stays the latest checkpoint" if prev else "no earlier checkpoint exists"
        kind = StaleWriterError if err.startswith("stale writer: ") else CheckpointSaveError
        head = f"checkpoint {step_folders.step_name(step)} in {self.root} was not saved: {err.rstrip('.')}."
        error = kind(f"{head} {keep}.")
        error.head = head  # what `save` reports once a later save changed the latest
        raise error

    def _manifest_info(self, state: TrainState, sd: dict) -> dict:
        from disttrain.version import __version__

        return {
            "step": state.step,
            "epoch": state.epoch,
            "generation": self.generation,
            "run_id": self.run_id,
            "world_size": self.world,
            "strategy": strategy_of(state.model),
            "tp": tp_degree(state.model),
            "storage": RAW_FORMAT,
            "config_hash": config_hash(state.config) if state.config is not None else None,
            "torch_version": torch.__version__,
            "disttrain_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def _remove_later(self, path: Path) -> None:
        """Delete a pruned (already renamed-aside) directory off the save's path."""
        self._removals.append(self._remover.submit(shutil.rmtree, path, ignore_errors=True))

    def _join_removals(self) -> None:
        for f in self._removals:
            f.result()
        self._removals = []

    def wait(self) -> Path | None:
        """Complete the in-flight async save, if any. Raises its `CheckpointSaveError`
        or `StaleWriterError` (on every rank). Returns the committed directory or None."""
        future, self._inflight = self._inflight, None
        return future.result() if future is not None else None

    def close(self) -> None:
        """`wait()`, then release the worker thread (the gloo group lives with the
        default group)."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self._join_removals()
            self._remover.shutdown(wait=True)
            self._syncer.shutdown(wait=True)
            self._async.close()

    # ------------------------------------------------------------ load

    def load(self, state: TrainState, path: str | Path | None = None, *, strict: bool = True) -> Path | None:
        """Load the newest valid checkpoint under `root` (or the step directory
        `path`) into `state`, resharding as needed. A collective.

        Returns the loaded directory, or None when there is none (a fresh start).
        Raises `CheckpointCorrupt` (the newest is damaged and `fallback` is off, or
        none is valid) or `CheckpointMismatch` (another model), the same on every rank.
        A damaged file may be found after part of `state` was overwritten: after
        an error, load again (or start afresh) before training on. Where the time
        went is in `last_load_phases` afterwards (`load_phases`).
        """
        self.wait()
        with load_phases.recording() as self.last_load_phases:
            step_dir = self._load(state, Path(path) if path else None, strict)
        if step_dir is not None:
            LOGGER.debug(f"disttrain checkpoint: loaded {step_dir.name}, {load_phases.summary(self.last_load_phases)}")
        return step_dir

    def _load(self, state: TrainState, path: Path | None, strict: bool) -> Path | None:
        from disttrain.checkpoint.hashing_fs import load_one

        with load_phases.phase("find"):
            if path is not None and path.name.startswith("step-"):
                candidates = [path]
            else:
                step_folders.note_empty_step_dirs(path or self.root, self.rank)
                candidates = list(
                    map(
                        Path,
                        self._bcast(
                            [str(p) for _, _, p in step_folders.committed(path or self.root)]
                            if self.rank == 0
                            else None,
                            list[str],
                        ),
                    )
                )
        if not candidates:
            return None  # a fresh start: no state_dict(), whose optimizer-state init counts a step
        with load_phases.phase("targets"):
            sd, notes = {"tensors": state.tensor_state()}, []  # meta and RNG come from their files
        fqns = param_fqns(sd)  # a load replaces the optimizer groups' names with the checkpoint's
        for step_dir in candidates:
            err = load_one(step_dir, sd["tensors"], strict, self.rank, self.world, self.pg, self._gather)
            if err is None:
                break
            if not self.fallback or len(candidates) == 1 and path is not None:
                raise CheckpointCorrupt(
                    f"{err} Refusing to load {step_dir.name}. Set checkpoint.fallback "
                    f"= true to load the previous valid checkpoint instead."
                )
            notes.append(f"skipped corrupt checkpoint {step_dir.name}: {err}")
            LOGGER.warning(f"disttrain checkpoint: warning: {notes[-1]}")
        else:
            raise CheckpointCorrupt(f"no valid checkpoint in {path or self.root} ({'; '.join(notes)}).")
        with load_phases.phase("hand over"):
            self._hand_over(state, sd, fqns, step_dir)
        return step_dir

    def _hand_over(self, state: TrainState, sd: dict, fqns, step_dir: Path) -> None:
        """Give `state` the loaded tensors `sd` and the JSON parts of `step_dir`, each
        parsed from the very bytes checked against its manifest record (`read_own`)."""
        manifest = step_folders.read_manifest(step_dir)
        files, rng_file = manifest["files"], f"rank-{self.rank:05d}.json"
        same_world = manifest.get("world_size") == self.world
        if "state.json" not in files:  # only verified files are read
            raise CheckpointCorrupt(f"{step_dir}: the manifest lists no state.json.", "state.json")
        sd["meta"] = _json_file(step_dir, "state.json", files["state.json"])
        rng = _json_file(step_dir, rng_file, files[rng_file]) if same_world and rng_file in files else None
        for key in ("step", "epoch"):
            if not step_folders.count(sd["meta"].get(key)):
                raise CheckpointCorrupt(
                    f"{step_dir / 'state.json'}: its {key} is not a whole number >= 0.", "state.json"
                )
        _handed(step_dir / "state.json", lambda: state.load_state_dict({**sd, "rng": None}, param_fqns=fqns))
        if rng is not None:
            _handed(step_dir / rng_file, lambda: set_rng_state(rng), RuntimeError)
        if not same_world:
            LOGGER.info(
                f"disttrain checkpoint: note: {step_dir.name} was saved at world size "
                f"{manifest.get('world_size')}, loaded at {self.world}: weights and optimizer "
                f"are resharded; per-rank RNG streams start fresh."
            )


def _json_file(step_dir: Path, name: str, want: dict) -> dict:
    """The JSON object of the file `name` of `step_dir`, parsed from the bytes checked
    against its manifest record `want` (`own_files.read_own`), nested at most
    `json_text.MAX_DEPTH` deep. Raises `CheckpointCorrupt` (or `CheckpointUnsafe`)
    naming it."""
    try:
        value = json_text.loads(read_own(step_dir, name, want))
    except (OSError, ValueError) as e:
        raise CheckpointCorrupt(f"{step_dir / name} cannot be read as JSON ({e}).", name) from None
    if not isinstance(value, dict):
        raise CheckpointCorrupt(f"{step_dir / name} holds a {type(value).__name__}, not a JSON object.", name)
    return value


def _handed(path: Path, hand, *also: type[Exception]) -> None:
    """Run `hand()`, which gives the state what the checkpoint file `path` holds; what
    it raises on a value of the wrong type or range (a step that is a string, an RNG
    state of the wrong length) is `CheckpointCorrupt` naming the file: the values of a
    file that passed its checksum were written so, by hand or by another program.
    `also`: more exception types to read so (torch's `RuntimeError` for an RNG state)."""
    caught: tuple[type[Exception], ...] = (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError)
    try:
        hand()
    except caught + also as e:
        why = str(e).strip().splitlines()
        raise CheckpointCorrupt(
            f"{path} holds a value this state cannot take ({type(e).__name__}: {why[0][:200] if why else ''}).",
            path.name,
        ) from None
