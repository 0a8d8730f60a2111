"""The last line `disttrain run` prints when a job ends other than cleanly, and the
exit status that goes with it: a failure's other ranks, a signal to the launcher, a
hang, a slot that left fast recovery, a job that shrank or grew in memory. Words only:
`run_command._launch` decides which applies. Imports no torch."""

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
