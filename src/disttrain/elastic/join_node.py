"""A node that joins a running fast-recovery job (`disttrain run --join`), admitted at a
step boundary with no restart: the running ranks keep their processes and their state
(docs/elastic.md, "A node that joins a running job").

- Growing needs the etcd store (`--rdzv-backend etcd`): a joining node must find the
  store, and a TCP store lives on one node of the job, at an address the newcomer does
  not know. The job's global rank 0 publishes, sealed with the job's secret, where its
  round lives (`publish`: the round's directory, the training world and torchrun's slot
  count) under the run id's directory (`etcd_store.run_prefix`).
- The joining node runs a torchrun of its own (standalone), so the job's agents see no
  new node and restart nothing. Its slot supervisors find the job (`find_job`), take
  slot numbers past every slot given so far (`reserve`: one counter, so two joining
  nodes never share a number, and one node's slots are consecutive) and stand by like
  hot-spare slots (`slot_supervisor._stand_by`): they beat and keep a warm spare, which
  says once it is warm that its slot is ready (`mark_ready`).
- At a step boundary, at most every `POLL_S`, rank 0 looks for ready joined slots
  (`ready`); its request rides on the step's preemption vote
  (`fast_recovery.Handoff.joiners_waiting`), so a job no node joins makes no collective
  for it. At the step the vote is read, rank 0 writes the roster with them appended
  (`admit`) and every rank learns it from one all-gather
  (`fast_recovery.Handoff.admit_joiners`). Each leaves the
  generation with `Regroup` once the step's buddy copy is complete; the next generation
  takes the committed state from memory (under DDP by broadcast, under FSDP resharded
  from the packs: `elastic.buddy_reshard`), and no step is redone.
- A joined node started with another config (or model, code, library) fails that
  generation's start checks. When only ranks new to the job differ from the ones that
  trained before (`differing_newcomers`), those raise `NotAdmitted` (their node's
  error, not the job's) and the others `Refused`: the roster drops them for good
  (`membership.refuse`) and the next generation goes on from memory without them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from disttrain.elastic import etcd_store, membership
from disttrain.elastic.job_store import JobStore
from disttrain.errors import UserError
from disttrain.runtime import job_secret
from disttrain.runtime.log import LOGGER

RUN_ENV = "DISTTRAIN_JOIN_RUN"
"""Set by `disttrain run --join` on the joining node: the running job's run id (`--rdzv-id`)."""
JOB_KEY = "job"
"""In the run id's directory: where the running round is (`publish`)."""
POLL_S = 0.2
"""How often rank 0 asks the store whether a joined slot is ready (a step boundary may come sooner)."""
FIND_S = 60.0
"""How long a joining node waits for the job to publish itself."""
BLOCK_KEY = "disttrain/fast/block"
"""`BLOCK_KEY/<n>`: how many slots the joined node has whose first slot is torchrun's slot
count plus n (`reserve`)."""
MAX_SLOTS = 1 << 20
"""Bounds on what a joining node reads from the store: no job has more slots."""


class Regroup(BaseException):
    """Every rank leaves the generation at a step boundary to admit joined slots. A
    `BaseException`: the user's `except Exception` must not swallow it, and a `dt.Job`
    does not judge it a failure."""


class Refused(BaseException):
    """Every rank that stays leaves a generation whose newcomers differed from the
    running job at start (`fast_recovery.Handoff.refuse_newcomers`); the next
    generation goes on without them. A `BaseException`, as `Regroup`."""

    def __init__(self, slots: list[int], keys: list[str]) -> None:
        super().__init__(slots, keys)
        self.slots, self.keys = slots, keys

    def words(self, world: int) -> str:
        """The console's one line, on the job's rank 0."""
        return (
            f"disttrain run: slot(s) {self.slots} new to the job were not admitted: they differ from it at start "
            f"({', '.join(self.keys)}; their node says how); the job goes on in memory at world {world}"
        )


class NotAdmitted(UserError):
    """A newcomer's own error when it differed from the running job at start: its node
    stops with it, and the job goes on without it."""


def differing_newcomers(veteran: list[bool], prints: list[dict[str, str]]) -> tuple[list[int], list[str]]:
    """From each rank's flag (it passed an earlier generation's start checks: a veteran)
    and its start-check fingerprint (`dt.start_guard`'s, in rank order), after those
    checks failed: the ranks new to the job whose fingerprint differs from the
    veterans', and the keys that differ. ([], []) when no rank is a veteran, or the
    veterans differ among themselves (then the job's own ranks disagree: its error)."""
    veterans = [r for r, v in enumerate(veteran) if v]
    if not veterans or len(prints) != len(veteran) or any(prints[r] != prints[veterans[0]] for r in veterans):
        return [], []
    ref = prints[veterans[0]]
    odd = [r for r, v in enumerate(veteran) if not v and prints[r] != ref]
    keys = sorted({k for r in odd for k in set(ref) | set(prints[r]) if prints[r].get(k) != ref.get(k)})
    return odd, keys


@dataclass(frozen=True)
class RunningJob:
    """What a joining node needs of the job: its round's directory on the etcd, the
    slots that train from the start (`world`) and torchrun's slot count (`total`)."""

    round: str
    world: int
    total: int


def joinable() -> bool:
    """Whether nodes can join this job: its store is the etcd (`etcd_store.configured`)."""
    return etcd_store.configured() is not None


def _run_store(run_id: str, timeout_s: float, endpoint: str | None = None) -> JobStore:
    endpoint = endpoint or etcd_store.configured()
    assert endpoint is not None  # callers check `joinable` or name it
    store = etcd_store.connect(endpoint, timeout_s, prefix=etcd_store.run_prefix(run_id))
    return JobStore(store, job_secret.from_env())


def publish(world: int, total: int) -> None:
    """On global rank 0 of a joinable job: where this round lives, for joining nodes. A
    restarted round publishes its own; the last slot out removes it (`EtcdStore.remove_all`)."""
    record = {"round": etcd_store.round_prefix(), "world": world, "total": total}
    _run_store(os.environ.get("TORCHELASTIC_RUN_ID", "none"), 30).set(JOB_KEY, json.dumps(record))


def find_job(run_id: str, endpoint: str | None = None, wait_s: float = FIND_S) -> RunningJob:
    """The running job `run_id` on the etcd at `endpoint` (default: this job's), as it
    published itself. Raises `UserError` when none does within `wait_s` (a value that
    fails the job's seal is taken for absent), or the etcd does not answer."""
    endpoint = endpoint or etcd_store.configured()
    store, deadline = _run_store(run_id, wait_s, endpoint), time.monotonic() + wait_s
    while (text := _read_job(store, endpoint)) is None:
        if time.monotonic() > deadline:
            raise UserError(
                f"no fast-recovery job with --rdzv-id {run_id} is running on the etcd at {endpoint} "
                f"(waited {wait_s:.0f} s): start the job first, and give the joining node the job's --rdzv-id, "
                f"--rdzv-endpoint and DISTTRAIN_JOB_SECRET"
            )
        time.sleep(0.2)
    return _checked(json.loads(text))


def _read_job(store: JobStore, endpoint: str | None) -> str | None:
    """The job's record; None while it is absent. Raises `UserError` when the etcd does
    not answer, or the record does not carry this node's secret (another secret)."""
    try:
        text = store.get(JOB_KEY)
        if text is None and store.store.check([JOB_KEY]):
            raise UserError(
                "the running job was started with another DISTTRAIN_JOB_SECRET: export the job's own on "
                "the joining node (the job's values are sealed with it)"
            )
        return text
    except etcd_store.client_errors() as e:
        raise UserError(f"the etcd at {endpoint} does not answer ({e}); give the job's --rdzv-endpoint") from None


def _checked(record: object) -> RunningJob:
    """`record` as a `RunningJob`, its sizes bounded (sealed by the job, checked all the same)."""
    if not isinstance(record, dict):
        raise UserError(f"the running job's record on the etcd is not one a job writes: {record!r:.200}")
    world, total, where = record.get("world"), record.get("total"), record.get("round")
    if not (isinstance(world, int) and isinstance(total, int) and 0 < world <= total <= MAX_SLOTS):
        raise UserError(f"the running job's record on the etcd has no valid world sizes: {record!r:.200}")
    if not (isinstance(where, str) and where.startswith("disttrain/fast/") and len(where) < 512):
        raise UserError(f"the running job's record on the etcd names no round of it: {record!r:.200}")
    return RunningJob(where, world, total)


def reserve(store: JobStore, node: str, local_rank: int, nproc: int, timeout_s: float = 30) -> int:
    """The first of this joining node's `nproc` slot numbers, counted from torchrun's slot
    count (`membership.all_slots`): local rank 0 takes them from the job's counter for
    all, under `node` (this node's own torchrun run id); the others read it."""
    key = f"disttrain/fast/joining/{node}"
    if local_rank == 0:
        first = store.add(membership.JOINED_KEY, nproc) - nproc
        store.set(f"{BLOCK_KEY}/{first}", str(nproc))  # this node's slots, for `ready`
        store.set(key, str(first))
        return first
    deadline = time.monotonic() + timeout_s
    while (text := store.get(key)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"local rank 0 of this joining node took no slot numbers within {timeout_s:.0f} s")
        time.sleep(0.05)
    return int(text)


def mark_ready(store: JobStore, slot: int) -> None:
    """A joined slot's spare is warm (imports, datasets): it may be admitted."""
    store.add(f"disttrain/fast/ready/{slot}", 1)


def ready(store: JobStore, total: int, members: list[int]) -> list[int]:
    """The joined slots (numbered from `total`) in no roster and not gone, in order, of
    every joined node whose slots are all ready: a node's slots are admitted together, in
    one pause, and a node still warming up (or lost before it was ready) holds back no
    other. One store read when no node has joined."""
    end = membership.all_slots(store, total)
    if end == total:
        return []
    out = set(members) | set(membership.gone(store)) | set(membership.refused(store))
    admissible: list[int] = []
    for first, count in _blocks(store, total, end):
        pending = [s for s in range(first, first + count) if s not in out]
        if pending and all(store.add(f"disttrain/fast/ready/{s}", 0) > 0 for s in pending):
            admissible += pending
    return admissible


def _blocks(store: JobStore, total: int, end: int) -> list[tuple[int, int]]:
    """The joined nodes' slot ranges from `total` to `end`, as (first slot, count), in
    order; up to the first whose node has not yet written its count (`reserve`)."""
    blocks, first = [], total
    while first < end:
        text = store.get(f"{BLOCK_KEY}/{first - total}")
        count = int(text) if text is not None and text.isdigit() else 0
        if not 0 < count <= end - first:
            break
        blocks.append((first, count))
        first += count
    return blocks


_SAID: set[tuple[int, ...]] = set()


def fitting(joiners: list[int], members: list[int], fits: Callable[[int], bool]) -> list[int]:
    """The most of `joiners` (in order) that make a world `fits` accepts with `members`;
    the others stand by, said once per set of slots."""
    take = next((k for k in range(len(joiners), 0, -1) if fits(len(members) + k)), 0)
    if take < len(joiners) and tuple(joiners) not in _SAID:
        _SAID.add(tuple(joiners))
        LOGGER.warning(
            f"disttrain run: slot(s) {joiners[take:]} of a node that joined stand by: a world of "
            f"{len(members) + len(joiners)} does not keep the global batch (elastic.batch_policy = 'keep_global'; "
            f"'rescale_lr' takes any world)"
        )
    return joiners[:take]


def admit(store: JobStore, members: list[int], joiners: list[int], step: int) -> list[int]:
    """Write the roster with `joiners` after `members` (rank 0, before every rank learns
    it); the console's one line. Returns the roster."""
    after = members + joiners
    store.set(membership.ROSTER_KEY, json.dumps(after))
    LOGGER.warning(
        f"disttrain run: slot(s) {joiners} of a node that joined are admitted after step {step}; "
        f"the job goes on in memory at world {len(after)}"
    )
    return after
