"""The last line `disttrain run` prints when a job ends other than cleanly, and the
exit status that goes with it: a failure's other ranks, a signal to the launcher, a
hang, a slot that left fast recovery, a job that shrank or grew in memory. Words only:
`launch.job_end` decides which applies. Imports no torch."""

from __future__ import annotations

import signal


def others_clause(failures: dict, first: int, lost_peer: list[int]) -> str:
    """The clause on the ranks besides the first failure: those that failed of their own,
    and apart from them those the agent stopped with SIGTERM once the first failed and
    those that ended because they lost it (`lost_peer`, from their notes): they were
    healthy, and naming them as failed sends the user to the wrong rank."""
    stopped = sorted(r for r, f in failures.items() if r != first and f.exitcode == -signal.SIGTERM)
    lost = sorted(r for r in failures if r != first and r in lost_peer and r not in stopped)
    failed = sorted(r for r in failures if r != first and r not in stopped and r not in lost)
    parts = [f"also failed: ranks {failed}"] if failed else []
    if lost:
        parts.append(f"ranks {lost} lost their peer after that")
    if stopped:
        parts.append(f"ranks {stopped} were stopped by the launcher after that")
    return f" ({'; '.join(parts)})" if parts else ""


def stopped_by_signal(sigval: int, saved: int | None, failed: int) -> tuple[str, int]:
    """The last line and exit status of a job whose launcher got `sigval`: a rank's save
    after it (`saved`, its step) or a SIGTERM to a job that had not failed is a clean
    stop (0: a scheduler's requeue); a job stopped in the middle of failed attempts
    (`failed`: a crash loop, spare take-overs) with nothing saved after the signal is not."""
    name = signal.Signals(sigval).name
    if saved is not None:
        then = f"saved step {saved}. The same command resumes from it."
    else:
        then = (
            "had --shutdown-timeout to save, but no rank reported a checkpoint committed after the "
            "signal (a dt.Job commits one when the signal comes after its first step; a script "
            "without dt.Job saves only what its own handler saves)."
        )
        if failed:
            then += (
                f" The job had failed {failed} time(s) before the signal; a re-run resumes from the "
                "newest checkpoint on disk."
            )
    clean = sigval == signal.SIGTERM and (saved is not None or not failed)
    return f"disttrain run: stopped by {name}; the workers were passed it and {then}", 0 if clean else 128 + sigval


def hang_line(hang: dict) -> str:
    """The last line after a hang: the guard summary's own verdict (`worker_notes.note_hang`)."""
    lagging = [r for r in hang.get("lagging") or [] if isinstance(r, int)]
    who = (
        f"rank {lagging[0]} stopped making progress"
        if len(lagging) == 1
        else f"ranks {', '.join(map(str, lagging))} stopped making progress"
        if lagging
        else "no single rank stopped first"
    )
    return (
        f"the job hung and was stopped (exit status 124): {who}, as the guard's summary above says "
        f"(reported by rank {hang.get('reporter', '?')}, with every rank's line)."
    )


def restart_path_line(left: dict, restarted: bool = True) -> str:
    """The last line of a job in which a slot left fast recovery for torchrun's restart
    path (`worker_notes.note_restart_path`): `restarted`, the job finished after it; else
    torchrun had no restart left and the job failed."""
    why = f"rank {left.get('rank')} left fast recovery ({left.get('why')}) and took torchrun's restart path"
    if restarted:
        return f"finished; {why}: every worker restarted from the newest checkpoint."
    return (
        f"{why}, but torchrun had no restart left; give --max-restarts N to let torchrun restart every "
        f"worker from the newest checkpoint, or run the same command again to resume from it."
    )


def shrunk_line(shrunk: dict) -> str:
    """The last line of a job that finished after losing a node in memory or admitting a
    node that joined (`worker_notes.note_shrunk`): shrunk, with hot-spare slots in the
    lost ones' places, or grown."""
    lost, spares, joined = shrunk.get("lost"), shrunk.get("spares"), shrunk.get("joined")
    if joined:
        return (
            f"finished at world {shrunk.get('world')}: slot(s) {joined} of nodes that joined were admitted in "
            f"memory{f', rank(s) {lost} lost with their node,' if lost else ''} with no torchrun restart."
        )
    if spares:
        return (
            f"finished at world {shrunk.get('world')}: rank(s) {lost} were lost with their node and hot-spare "
            f"slot(s) {spares} took their places in memory, with no torchrun restart."
        )
    return (
        f"finished at world {shrunk.get('world')}: rank(s) {lost} were lost with their node "
        f"and the others went on without them in memory, with no torchrun restart."
    )


def closed_by_another_line(lost_peer: list[int]) -> str:
    """The last line of a node whose ranks lost their peers because another node's rank
    stopped the job (that node closed the rendezvous: `launch.rendezvous_end`)."""
    who = f"rank(s) {lost_peer} of this node lost their peers" if lost_peer else "this node's ranks stopped"
    return (
        f"another node stopped the job and closed its rendezvous ({who}): that node's output says why "
        f"(its rank's error and last line); nothing was restarted."
    )


def rendezvous_timeout_line(nnodes: str | None) -> str:
    """The last line of a node whose rendezvous did not fill within its join timeout."""
    return (
        f"the rendezvous did not fill within its join timeout: fewer nodes than --nnodes {nnodes or '?'} "
        f"joined (a node was lost or ended, or was never started with the same --rdzv-id and endpoint). Start "
        f"every node with the same command; a run resumes from its newest checkpoint."
    )


def rendezvous_gone_line(endpoint: str | None, backend: str | None) -> str:
    """The last line of a node whose rendezvous stopped answering when the agent needed
    it: under c10d it lives in the agent of the node that hosts it and ends with that
    node; an etcd of its own was stopped or cannot be reached."""
    if backend in ("etcd", "etcd-v2"):
        return (
            f"the etcd at {endpoint or '?'} does not answer, and this node's agent needed it to go on (a "
            f"restart, a node joining); start it again on the same address and data directory, then run "
            f"the same command to resume from the newest checkpoint."
        )
    return (
        f"the rendezvous at {endpoint or '?'} stopped answering: the node that hosts it ended or was lost "
        f"(its output says why), and with it the job; nothing was restarted. --rdzv-backend etcd keeps it "
        f"on a server of its own, so that any node can be lost."
    )


def rendezvous_reused_line(run_id: str | None, endpoint: str | None) -> str:
    """The last line of a node refused at its first rendezvous because the run id's
    rendezvous is closed: a job with that id ended there (torch closes it at a job's end;
    on etcd it stays for the key's time to live, 2 hours by default)."""
    return (
        f"the rendezvous of --rdzv-id {run_id or 'none'} at {endpoint or '?'} is closed: a job with this id "
        f"already ended there (torch closes a job's rendezvous at its end; on etcd it stays closed for up to "
        f"2 hours). Give each job its own --rdzv-id, the same on every node of it; a run with a new id "
        f"resumes from its newest checkpoint as the same command would."
    )
