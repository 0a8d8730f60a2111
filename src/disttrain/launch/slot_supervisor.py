"""`python -m disttrain.launch.slot_supervisor MODULE ARGS...`: one torchrun worker slot
under `[elastic] fast_recovery = true` (docs/elastic.md). `disttrain run` starts it in
place of `-m disttrain.train` when the config asks for fast recovery.

The supervisor is the process torchrun watches. It starts the slot's training process
(`python -m MODULE ARGS`) as its child, and a warm spare: the same command, which
imports torch and disttrain, builds its datasets and then waits on its stdin. Under
`disttrain run` both are forked from its warm server (launch/warm_workers.py) through
a stub, so neither pays for the imports. When
the training process is killed by a signal, the supervisor promotes the spare (one
line on its stdin) and starts a new spare in the background once the take-over is
over (`REPLACE_AFTER_S`); torchrun sees nothing.
A spare that dies is replaced the same way. Global rank 0's supervisor also hosts the
`TCPStore` (at MASTER_ADDR:MASTER_PORT) on which the training processes agree on
generations, so the store outlives any training process (under the etcd rendezvous
the store is the etcd, which outlives any node, and the last slot out removes the
round's keys: `elastic.etcd_store`, `elastic.membership.finish`). It listens on
MASTER_ADDR's address only, and the ranks seal what they write to it with the job's secret
(DISTTRAIN_JOB_SECRET, from `disttrain run`; `elastic.job_store`): without one the
supervisor refuses to start.

What falls back to torchrun's restart and the disk checkpoint: a training process
that exits with a status (an error, a hang the watchdog reported), more than
`MAX_PROMOTIONS` deaths, or the loss of a supervisor (its children get SIGKILL from
the kernel: `PR_SET_PDEATHSIG`). SIGTERM and SIGINT are passed to the training
process (a preemption: it saves and exits 0). The supervisor exits with its training
process's status (128 + signal when killed by one).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from disttrain.errors import UserError
from disttrain.launch import stop_sharing
from disttrain.launch.warm_workers import SOCKET_ENV as WARM_SOCKET_ENV
from disttrain.runtime import job_secret, processes
from disttrain.runtime.failures import MACHINE, classify_death, report_crash
from disttrain.worker_notes import (
    earlier_stop,
    first_to_say,
    note_standby_lost,
    note_stood_by,
    read_step,
    report_not_retried,
    wait_to_be_stopped,
)

ROLE_ENV = "DISTTRAIN_FAST_ROLE"  # elastic.fast_recovery.ROLE_ENV; not imported: that imports torch
TOTAL_SLOTS_ENV = "DISTTRAIN_TOTAL_SLOTS"  # elastic.fast_recovery.TOTAL_SLOTS_ENV
FAST_STORE_ENV = "DISTTRAIN_FAST_STORE"  # elastic.etcd_store.STORE_ENV: the store is that etcd
MAX_PROMOTIONS = 1000
STANDBY_POLL_S = 0.05
"""How often a hot-spare slot asks the store whether a roster names it."""
TRAINING_WORLD_ENV = "DISTTRAIN_TRAINING_WORLD"  # elastic.membership's; not imported: that imports torch
JOIN_RUN_ENV = "DISTTRAIN_JOIN_RUN"  # elastic.join_node.RUN_ENV: this node joins a running job
STORE_LINGER_S = 60.0
"""How long the store's host waits for every rank to finish with it after its own
training process is done."""
REPLACE_AFTER_S = 3.0
"""How long after a promotion the slot's next spare starts: its start (the worker's
stub and entry, the datasets, the warm-up imports, 0.3-0.7 s of CPU each, traced) must
not take the CPU from the take-over it follows (0.4-1.5 s here). A death in that
window is taken over by a spare started then."""


def _spawn(cmd: list[str], role: str) -> subprocess.Popen:
    # torchrun's world (the hot spares' slots included) as this process has it now: a
    # joined node's is the job's (`_joined_slot`)
    env = {**os.environ, ROLE_ENV: role, TOTAL_SLOTS_ENV: os.environ["WORLD_SIZE"]}
    stdin = subprocess.PIPE if role == "spare" else subprocess.DEVNULL
    return subprocess.Popen(cmd, env=env, stdin=stdin, preexec_fn=processes.die_with_parent)


def _promote(cmd: list[str], spare: subprocess.Popen | None) -> tuple[subprocess.Popen, str]:
    """Promote the slot's spare; return it and, for the console, which spare it is: a
    warm one, or one started now because there is none (a death within
    `REPLACE_AFTER_S` of the last promotion) or it died just now (not yet reaped)."""
    if spare is None:
        why = f"no warm one yet: the slot's last take-over was under {REPLACE_AFTER_S:.0f} s ago"
    else:
        try:
            _go(spare)
            return spare, "its warm spare"
        except OSError:
            spare.kill()
        why = "its warm spare had just exited"
    spare = _spawn(cmd, "spare")
    _go(spare)
    return spare, f"a spare started now ({why})"


def _wait_child(spare_at: float | None) -> tuple[int, int]:
    """`os.wait()`: the next child to end and its status; (0, 0) once `spare_at` (a
    monotonic time) has passed with none ended. Without `spare_at` it blocks, polling
    nothing, so nothing competes with training; with one it looks every 0.05 s."""
    while spare_at is not None:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            return pid, status
        left = spare_at - time.monotonic()
        if left <= 0:
            return 0, 0
        time.sleep(min(0.05, left))
    return os.wait()


def _host_store():
    """Global rank 0's slot: the store every generation rendezvouses on, listening only
    on MASTER_ADDR's address (`elastic.job_store.host_store`); None under the etcd
    rendezvous, whose etcd is the store and needs no host."""
    if os.environ.get(FAST_STORE_ENV):
        return None
    from disttrain.elastic.job_store import host_store

    return host_store(timeout_s=300)


def _go(spare: subprocess.Popen) -> None:
    """Promote a spare: one line on its input (a pipe: `_spawn`)."""
    assert spare.stdin is not None
    spare.stdin.write(b"go\n")
    spare.stdin.flush()


def _end(proc: subprocess.Popen | None) -> None:
    """End a spare: end of input makes it exit 0; SIGKILL if it does not within 5 s."""
    if proc is None or proc.poll() is not None:
        return
    assert proc.stdin is not None  # spares start with a pipe (_spawn)
    try:
        proc.stdin.close()
        proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()


def _how(rc: int) -> str:
    """How a training process ended, in the classifier's words (`runtime.failures`)."""
    verdict = classify_death(rc)
    whose = (
        "the machine's: a kill from outside, the OOM killer included"
        if verdict.kind == MACHINE
        else "a signal that cannot be classified, retried like the machine's"
    )
    return f"{verdict.error}, {whose}"


def _not_to_retry(rank: int, rc: int, last_death: str | None) -> tuple[bool, str]:
    """Whether the training process's death by signal -`rc` must not be taken over by
    the spare (the note that stops the job is written), and the death's signature for
    the next one: the program's death (a native crash, an abort), or the same signal at
    the same step as the slot's death before (the crash-loop breaker: spare take-overs
    count as attempts; the step is the one the process had marked, `read_step`)."""
    step = read_step(rank)
    death = f"{classify_death(rc).error} at step {step}"
    if report_crash(rank, rc):
        return True, death
    if step is None or death != last_death:  # no step known (outside `disttrain run`): no breaker
        return False, death
    report_not_retried(
        f"stopped: rank {rank}'s training process died of {death} twice in a row, so a spare "
        f"would die there again; not retried",
        128 - rc,
    )
    return True, death


def _beat(rank: int) -> threading.Event:
    """Beat for this slot on the job's store from a thread (`elastic.membership`), and
    listen for its liveness probes (`elastic.liveness`), so the survivors tell a lost
    node from a killed training process; set the event to stop."""
    from disttrain.elastic import job_store, liveness, membership

    stop = threading.Event()

    def run() -> None:
        try:
            store = job_store.connect(timeout_s=300)
            liveness.listen(store, rank)  # refused once this process is gone: no lease to wait
        except (RuntimeError, ConnectionError, TimeoutError, OSError):
            return  # no store: no shrink in memory; the restart path remains
        membership.beat(store, rank, stop)

    threading.Thread(target=run, name="disttrain-beat", daemon=True).start()
    return stop


def _stand_by(cmd: list[str], rank: int, world: int, stopping: list[int]) -> subprocess.Popen | None:
    """A hot-spare slot (`--spare-nodes`: its rank is past the training world `world`):
    keep a warm spare until a roster names this slot, then promote it and return it (the
    slot's training process from then on); None when the job ends first (every rank in
    it done, a stop, a signal). Polls the job's store every `STANDBY_POLL_S`."""
    from disttrain.elastic import job_stop, job_store, membership

    spare = _spawn(cmd, "spare")
    try:
        store = job_store.connect(timeout_s=300)
        while not stopping and not earlier_stop() and not job_stop.adopt(store):
            if spare.poll() is not None:  # a dead spare: replaced (its status, reaped here)
                print(
                    f"disttrain run: hot-spare slot {rank}'s spare exited ({spare.returncode}); starting another",
                    file=sys.stderr,
                    flush=True,
                )
                spare = _spawn(cmd, "spare")
            members = membership.roster(store, world)
            if rank in members:
                return _promote(cmd, spare)[0]
            if store.add(membership.DONE_KEY, 0) >= len(members):  # the job is over
                break
            membership.await_roster(store, STANDBY_POLL_S)  # on the etcd: woken by the roster's change
        note_standby_lost(membership.found_dead_standby(store))  # this node's exit barrier
        # counted out (on a stop and a signal too): the store's host waits for it
        membership.finish(store, world, int(os.environ["WORLD_SIZE"]), standby=True)
    except (RuntimeError, ConnectionError, TimeoutError, OSError):
        pass  # the store is gone: the job is over (its host left) or lost; torchrun sees this slot end
    _end(spare)
    return None


def supervise(cmd: list[str], rank: int, world: int) -> int:
    """Run the slot until its training process is done; return the exit status. `world`:
    the slots that train (a slot past it is a hot spare's: `_stand_by`)."""
    store = _host_store() if rank == 0 else None
    beating = _beat(rank)
    stop_sharing.share()  # a crash it reports reaches the other nodes
    stopping: list[int] = []
    if rank >= world:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: stopping.append(signum))
        promoted = _stand_by(cmd, rank, world, stopping)
        if promoted is None:
            beating.set()
            note_stood_by(rank)
            return 0
        child, spare, spare_at = promoted, None, time.monotonic() + REPLACE_AFTER_S
    else:
        child, spare, spare_at = _spawn(cmd, "first"), _spawn(cmd, "spare"), None

    def forward(signum, _frame):
        stopping.append(signum)
        try:  # os.kill, not Popen.send_signal: that would reap the child behind os.wait's back
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    promotions = 0
    last_death: str | None = None
    while True:
        pid, status = _wait_child(spare_at)
        if pid == 0:  # the take-over is over: the next spare starts (none once the job stops)
            spare, spare_at = (None if stopping else _spawn(cmd, "spare")), None
            continue
        code = os.waitstatus_to_exitcode(status)
        if spare is not None and pid == spare.pid:  # a killed spare: replaced in the background
            spare.returncode = code
            if not stopping:
                print(
                    f"disttrain run: rank {rank}'s spare exited ({code}); starting another", file=sys.stderr, flush=True
                )
                spare = _spawn(cmd, "spare")
            continue
        if pid != child.pid:
            continue
        child.returncode = rc = code
        if rc < 0 and not stopping:
            stop, last_death = _not_to_retry(rank, rc, last_death)
            if stop:  # the launcher stops the job now; its SIGTERM ends this process
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                wait_to_be_stopped()
                break
        if rc < 0 and not stopping and promotions < MAX_PROMOTIONS:
            spare, who = _promote(cmd, spare)
            promotions += 1
            first_to_say(f"promotion-rank{rank}-{promotions:06d}")  # counted if the job is then stopped
            print(
                f"disttrain run: rank {rank}'s training process died ({_how(rc)}); {who} "
                f"took over and the job goes on from memory (take-over {promotions})",
                file=sys.stderr,
                flush=True,
            )
            child, spare, spare_at = spare, None, time.monotonic() + REPLACE_AFTER_S
            continue
        break
    beating.set()
    _end(spare)
    # Keep the store up until every rank is done with it; not when a rank stopped the job
    # (its error is the launcher's to report): the others may never say they are done.
    if store is not None and rc == 0 and not earlier_stop():
        _linger(store, world)
    return rc if rc >= 0 else 128 - rc


def _linger(store, world: int) -> None:
    """Keep the TCP store this slot hosts (global rank 0's, under c10d) until every slot
    has counted itself out (`membership.everyone_done`: the training ranks, then the
    hot-spare slots still standing by), at most `STORE_LINGER_S`. (An etcd store has no
    host: the last slot out removes the round's keys, `membership.finish`.)"""
    from disttrain.elastic import job_store, membership

    sealed = job_store.JobStore(store, job_secret.from_env())
    total = int(os.environ["WORLD_SIZE"])
    deadline = time.monotonic() + STORE_LINGER_S
    while time.monotonic() < deadline and not membership.everyone_done(sealed, world, total):
        time.sleep(0.05)


def _joined_slot() -> tuple[int, int]:
    """On a node that joins a running job (`disttrain run --join`): find the job, take this
    slot's number past every slot it has (`elastic.join_node`) and point this process's
    environment (its children's too) at the job's round. Returns (slot, the job's
    training world): the slot stands by until the job admits it. Raises `UserError`
    when no such job runs."""
    from disttrain.elastic import etcd_store, job_store, join_node

    job = join_node.find_job(os.environ[JOIN_RUN_ENV])
    os.environ[etcd_store.ROUND_ENV] = job.round
    store = job_store.connect(timeout_s=30)
    local, nproc = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    slot = job.total + join_node.reserve(store, os.environ.get("TORCHELASTIC_RUN_ID", "none"), local, nproc) + local
    os.environ.update({"RANK": str(slot), "WORLD_SIZE": str(job.total), TRAINING_WORLD_ENV: str(job.world)})
    os.environ.pop("DISTTRAIN_EXPECTED_WORLD_SIZE", None)  # this node's count is not the job's
    return slot, job.world


def main(argv: list[str]) -> int:
    if not argv:
        print(
            "usage: python -m disttrain.launch.slot_supervisor MODULE [ARGS...] (started by "
            "`disttrain run` for [elastic] fast_recovery = true)",
            file=sys.stderr,
        )
        return 2
    if "RANK" not in os.environ or "MASTER_PORT" not in os.environ:
        print(
            "disttrain: the slot supervisor runs under torchrun (`disttrain run` or `disttrain "
            "train` start it); RANK or MASTER_PORT is not set.",
            file=sys.stderr,
        )
        return 2
    try:
        job_secret.from_env()  # the ranks need it for every value they share
    except UserError as e:
        print(f"disttrain: {e}", file=sys.stderr)
        return 2
    # Under `disttrain run` the training processes and spares fork from its warm server
    # (torch already imported): a spare is ready in a fraction of a second, not after an
    # interpreter's imports. Without a server the stub runs the module itself.
    warm = ["disttrain.launch.warm_workers"] if os.environ.get(WARM_SOCKET_ENV) else []
    processes.name_worker("slot")
    try:
        rank, world = _joined_slot() if os.environ.get(JOIN_RUN_ENV) else (int(os.environ["RANK"]), 0)
    except UserError as e:
        print(f"disttrain: {e}", file=sys.stderr)
        return 2
    world = world or int(os.environ.get(TRAINING_WORLD_ENV) or os.environ["WORLD_SIZE"])
    return supervise([sys.executable, "-m", *warm, *argv], rank, world)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
