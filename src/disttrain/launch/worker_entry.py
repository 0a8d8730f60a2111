"""`python -m disttrain.launch.worker_entry (-m MODULE | SCRIPT) [ARGS]`: how `disttrain
run` starts each worker, so that no worker outlives its launcher.

torchrun starts every worker in a session of its own, so a launcher killed with
SIGKILL (an OOM killer, `kill -9`, a lost terminal) leaves them running as orphans,
holding memory, devices and ports. This entry asks the kernel for a parent-death
signal (`prctl(PR_SET_PDEATHSIG, SIGKILL)`, Linux) before the user's code runs, then
runs the script or module as `__main__`, exactly as `python SCRIPT` or `python -m
MODULE` would (sys.argv, sys.path[0], `__main__`).

The signal is asked for only when this process's parent is the launcher itself
(`LAUNCHER_ENV` holds its pid): a process that the launcher did not start directly
(a warm-worker fork, a slot supervisor's child) has another parent. A launcher that
died before the request took effect is seen (the parent pid is no longer it), and the
worker exits at once.
"""

from __future__ import annotations

import os
import runpy
import sys

from disttrain.runtime import processes

LAUNCHER_ENV = "DISTTRAIN_LAUNCHER_PID"
"""The launching process's pid, set by `disttrain run` for its workers."""
STOP_RELAY_ENV = "DISTTRAIN_STOP_RELAY"  # elastic.note_relay.RELAY_ENV; not imported: that imports torch
ORPHAN_EXIT_CODE = 129
"""Exit status of a worker that found its launcher already gone (128 + SIGHUP)."""


def die_with_launcher() -> bool:
    """Ask for SIGKILL when the launcher dies. Returns True when the request was made;
    exits when the launcher is already gone. A no-op off Linux or outside `disttrain run`."""
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return False
    if os.getppid() != int(launcher):
        return False  # started by another process of the job, which has its own parent
    if not processes.die_with_parent():
        return False
    if os.getppid() != int(launcher):  # it died between our start and the request
        os._exit(ORPHAN_EXIT_CODE)
    return True


def watched_by_parent() -> None:
    """Fork: the child returns and runs the worker; this process becomes its stub
    (`worker_watch.watch`) and never returns. For a worker that the launcher started
    directly, without a warm server: a death by signal is then judged as a warm
    worker's is (a native crash is the program's, with its stack), and torchrun still
    sees the worker's own status or signal."""
    pid = os.fork()
    if pid == 0:
        processes.die_with_parent()  # the stub's death (torchrun's SIGKILL) takes the worker
        return
    from disttrain.launch.worker_watch import watch

    os._exit(watch(pid, lambda: os.waitpid(pid, 0)[1]))


def main(argv: list[str]) -> None:
    """Run `argv` (`-m MODULE ARGS` or `SCRIPT ARGS`) as `__main__` after `die_with_launcher`."""
    direct = die_with_launcher()
    from disttrain.worker_notes import earlier_stop, wait_to_be_stopped

    if earlier_stop():  # a peer's user error came first (or a restart slipped through)
        # The launcher stops the job within a poll: an exit now would reach torchrun's
        # agent first, as a failure with its own lines (and a restart).
        wait_to_be_stopped()
        os._exit(2)
    os.environ.pop(LAUNCHER_ENV, None)  # the worker's own children have another parent
    if not (
        argv[:1] == ["-m"] and argv[1:2] in (["disttrain.launch.warm_workers"], ["disttrain.launch.slot_supervisor"])
    ):
        if direct:  # no stub of a warm server in front: this process becomes one
            watched_by_parent()
        processes.name_worker(announce=announcer(argv))  # a stub or supervisor names itself
        from disttrain.runtime.failures import record_native_crashes

        record_native_crashes()  # a native crash shows the Python line it happened at
        if os.environ.get(STOP_RELAY_ENV):  # other nodes: this rank's stop or finish reaches them
            from disttrain.elastic import note_relay

            note_relay.share_from_worker()
    if not (argv[:1] == ["-m"] and argv[1:2] and argv[1].startswith("disttrain.")):
        # A user's script: a hang names the rank that stopped (Job's watchdog takes over
        # at wrap). disttrain's own modules (the trainer, a supervisor) have their own.
        from disttrain.guard.script_watchdog import start_for_script
        from disttrain.runtime.process_group import hold_script_groups

        start_for_script()
        hold_script_groups()  # a correct script must not hang at exit (freeing a destroyed group)
        start_checks()
    if argv[:1] == ["-m"] and len(argv) > 1:
        sys.argv = [argv[1], *argv[2:]]
        keep_globals(runpy.run_module(argv[1], run_name="__main__", alter_sys=True))
        finish_checks()
        if direct:  # the watched child of `watched_by_parent`: a bounded exit
            from disttrain.runtime.exit_bound import end_process

            end_process(0)
        return
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    from disttrain import worker_notes
    from disttrain.runtime import failures

    failures.watch_interrupts()
    try:
        keep_globals(runpy.run_path(script, run_name="__main__"))
        finish_checks()
        worker_notes.note_finished(int(os.environ.get("RANK", "0")))
    except Exception as e:  # a dt.Job has judged its own failure already (failures.JudgedExit)
        script_failed(e)
    except (SystemExit, KeyboardInterrupt) as e:
        if not failures.is_program_exit(e):
            if isinstance(e, SystemExit):
                finish_checks()  # sys.exit(0): an end the other ranks' checks compare with theirs
            raise
        script_failed(e)
    else:
        if direct:  # the watched child of `watched_by_parent`: a bounded exit
            from disttrain.runtime.exit_bound import end_process

            end_process(0)


def script_failed(exc: BaseException) -> None:
    """A plain script's exception under `disttrain run`, judged as a `dt.Job`'s is
    (`runtime.failures`, docs/elastic.md): the program's error goes to the launcher,
    which prints it last and stops the job without a restart; a rank whose peer stopped
    the job exits 0, silent; a lost peer is one line (the trace in the rank's log), exit
    1 for torchrun to restart. The script's steps are unknown here."""
    from disttrain import worker_notes
    from disttrain.runtime import failures

    if not worker_notes.under_launcher():
        raise exc
    from disttrain.elastic import note_relay

    rank, verdict = int(os.environ.get("RANK", "0")), failures.classify(exc)
    if verdict.kind != failures.PROGRAM and note_relay.adopt_in_worker():  # another node's rank stopped the job
        os._exit(0)
    if worker_notes.earlier_stop(0.0 if verdict.kind == failures.PROGRAM else worker_notes.PEER_NOTE_WAIT_S):
        os._exit(0)
    if failures.report_early_finish(rank, None, verdict):
        worker_notes.wait_to_be_stopped()
        sys.exit(1)
    if verdict.kind == failures.PROGRAM:
        failures.report_program_error(exc, rank, None, oom={} if verdict.oom else None)
        worker_notes.wait_to_be_stopped()
        sys.exit(failures.exit_status(exc))
    if verdict.kind == failures.MACHINE:
        worker_notes.note_lost_peer(rank)
    failures.say_once(
        f"disttrain run: rank {rank} {verdict.what} ({verdict.cause}); {failures.trace_to_log(rank, exc)}"
    )
    sys.exit(1)


def start_checks() -> None:
    """`disttrain run --check`: the checks in place before the user's script runs
    (`disttrain.check`); nothing, and no torch import, without it."""
    from disttrain.check.settings import window_from_env

    if window_from_env() is not None:
        from disttrain.check.session import install_from_env

        install_from_env()


def finish_checks() -> None:
    """The script returned: the checks' last exchange and summary, if they ran and it was
    not said yet."""
    if "disttrain.check.session" in sys.modules:
        from disttrain.check.session import finish

        finish()


def announcer(argv: list[str]) -> str:
    """Who says a worker's pid: the way the user started the job."""
    return "disttrain train" if "disttrain.train" in argv[:3] else "disttrain run"


def keep_globals(namespace: dict) -> None:
    """Keep a finished script's globals (runpy returns a copy) alive until the
    interpreter exits, as `python SCRIPT` keeps `__main__`'s. Dropped here, they would be
    freed while the process still runs: a DDP model left in a global then destroys its
    gloo process group with the GIL held, whose worker thread may need the GIL to free
    its last work, and the rank hangs after its script is done."""
    processes.STATE.kept.append(namespace)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m disttrain.launch.worker_entry (-m MODULE | SCRIPT) [ARGS]")
    main(sys.argv[1:])
