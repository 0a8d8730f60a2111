"""A program that ends its own process is the program's failure, never the machine's
(runtime/failures.py, docs/elastic.md "What is retried and what is not"): a native
crash, an abort (gloo's, on a collective no peer entered), `sys.exit(n)`, a
`KeyboardInterrupt` it raised. Real `disttrain run` jobs of tests/workers/failing_job.py
on gloo under both recovery paths: one attempt, the last line naming the cause and the
rank, the crash's Python line on the console, a non-zero status, and the newest
checkpoint there for a plain re-run to resume from. Every launch has a timeout: a job
that retries forever fails the test."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import WORKERS, built_once, run_disttrain, worker_env

SCRIPT = str(WORKERS / "failing_job.py")
PATHS = {"fast": ("--fast-recovery", "--nproc", "2"), "restart": ("--nproc", "2", "--max-restarts", "3")}
DEATHS = {
    # kind: (exit status, the last line's words after "rank 1 ", the script's line on the console)
    "segv": (139, "died of SIGSEGV, a crash in native code", "in fail"),
    "abort": (134, "died of SIGABRT, an abort in native code", "in fail"),
    "mismatch": (134, "died of SIGABRT, an abort in native code", "in fail"),
    "exit": (3, "called sys.exit(3) at step 6: the program's own exit", "sys.exit(3)"),
}


def newest_checkpoint_is_intact(out: Path) -> int:
    """The newest committed checkpoint's step, after verifying every file it lists."""
    from disttrain.checkpoint import step_folders

    newest = sorted((out / "checkpoints").glob("step-*"))[-1]
    return int(step_folders.verify(newest)["step"])


def launch(out: Path, path: str, *args: str, timeout: float = 150):
    proc = run_disttrain(["run", *PATHS[path], SCRIPT, str(out), *args], timeout=timeout, env=worker_env())
    return proc, proc.stdout + proc.stderr


@pytest.mark.parametrize("kind", sorted(DEATHS))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_program_that_ends_its_own_process_is_stopped_once(path, kind, tmp_path):
    """Before: a segfault or abort took 409 spare take-overs under fast recovery (never
    stopping) and four attempts under --max-restarts 3, with no trace; sys.exit(3) four
    attempts. After the segfault (checkpoints every 4 steps), a plain re-run resumes
    from step 4 and finishes."""
    status, words, shown = DEATHS[kind]
    proc, out = launch(tmp_path, path, "--raise-at", "6", "--kind", kind, "--steps", "12")
    assert proc.returncode == status, out[-3000:]
    assert len((tmp_path / "starts.log").read_text().splitlines()) == 1, out[-3000:]  # no retry
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith(f"disttrain run: not retried: rank 1 {words}"), last
    assert "the program's" in last and "took over" not in out and "lost a peer" not in out, out[-3000:]
    assert "failing_job.py" in out and shown in out, out[-3000:]  # where, on the console
    assert "death signal" not in out and "closing signal" not in out  # torchrun's words for a stop from outside
    assert newest_checkpoint_is_intact(tmp_path) == 4  # checkpoints every 4 steps; step 6 failed
    if (path, kind) == ("restart", "segv"):  # one crashed folder serves the re-run too
        again, out = launch(tmp_path, "restart", "--steps", "12")
        assert again.returncode == 0 and "resumed at step 4" in out and "done at step 12" in out, out[-3000:]


def test_a_native_crash_without_warm_workers_is_the_programs_too(tmp_path):
    """DISTTRAIN_WARM_WORKERS=0: each worker's entry watches its worker as a stub does.
    Before: four attempts under --max-restarts 3, no stack."""
    proc = run_disttrain(["run", *PATHS["restart"], SCRIPT, str(tmp_path), "--raise-at", "6", "--kind", "segv",
                          "--steps", "12"], timeout=150, env=worker_env(DISTTRAIN_WARM_WORKERS="0"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 139 and len((tmp_path / "starts.log").read_text().splitlines()) == 1, out[-3000:]
    assert proc.stderr.rstrip().splitlines()[-1].startswith("disttrain run: not retried: rank 1 died of SIGSEGV")
    assert "in fail" in out


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_raised_keyboard_interrupt_is_the_programs(path, tmp_path):
    proc, out = launch(tmp_path, path, "--raise-at", "6", "--kind", "interrupt", "--steps", "12")
    assert proc.returncode == 130, out[-3000:]
    assert len((tmp_path / "starts.log").read_text().splitlines()) == 1
    assert proc.stderr.rstrip().splitlines()[-1] == (
        "disttrain run: not retried: KeyboardInterrupt at step 6 on rank 1 is the program's error (exit status 130).")
    assert newest_checkpoint_is_intact(tmp_path) == 4


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_rank_that_ends_while_its_peers_train_is_named_as_the_cause(path, tmp_path):
    """Rank 1 returns from main() at step 6: rank 0's next collective fails. Before: rank
    0 "lost a peer" and was restarted (three times), or waited for a generation that
    never filled under fast recovery."""
    proc, out = launch(tmp_path, path, "--raise-at", "6", "--kind", "return", "--steps", "12")
    assert proc.returncode == 1, out[-3000:]
    assert len((tmp_path / "starts.log").read_text().splitlines()) == 1, out[-3000:]
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith("disttrain run: not retried: rank 1 finished its code (a return, a break or an exit 0 "
                           "on one rank only) while rank 0 still waited in a collective at step 6"), last
    assert "lost a peer" not in out


def test_a_hang_that_repeats_at_the_same_step_stops_the_job_and_the_last_line_names_the_rank(tmp_path):
    """Rank 1 sleeps forever at step 6 in every attempt (a hang cannot be classified: it is
    retried once). The second identical hang stops the job; every line names rank 1 as
    the rank that stopped making progress. Before: four attempts, each waiting the hang
    bound and the 30 s a non-reporting rank slept, and a last line calling the reporter
    "not the culprit" under a summary that named it."""
    proc, out = launch(tmp_path, "restart", "--raise-at", "6", "--kind", "sleep", "--steps", "12", "--hang-s", "3",
                       timeout=200)
    assert proc.returncode != 0, out[-3000:]
    assert len((tmp_path / "starts.log").read_text().splitlines()) == 2, out[-3000:]
    assert re.search(r"stopped: two attempts in a row ended with the same failure \(hang: rank\(s\) 1 stopped "
                     r"making progress at step \d+\)", out), out[-3000:]
    assert out.count("Lagging rank(s): 1.") == 2, out[-3000:]  # each attempt's summary: the same rank
    assert "not the culprit" not in out
    assert newest_checkpoint_is_intact(tmp_path) == 4


def test_a_hang_under_fast_recovery_ends_the_job_in_seconds_naming_the_rank(tmp_path):
    """Rank 1 sleeps forever at step 6 under fast recovery (no restart left): the hang is
    reported, the other rank leaves once the report is written (before: 30 s), and the
    last line names rank 1 as the summary does."""
    proc, out = launch(tmp_path, "fast", "--raise-at", "6", "--kind", "sleep", "--steps", "12", "--hang-s", "3",
                       timeout=120)
    assert proc.returncode == 124, out[-3000:]
    assert "Lagging rank(s): 1." in out, out[-3000:]
    assert proc.stderr.rstrip().splitlines()[-1].startswith(
        "disttrain run: the job hung and was stopped (exit status 124): rank 1 stopped making progress"), out[-3000:]
    assert newest_checkpoint_is_intact(tmp_path) == 4


def test_a_spare_take_over_that_repeats_at_the_same_step_stops_the_job(tmp_path):
    """kill -9 of rank 1 at step 6 in the first generation and again when its spare redoes
    step 6 (the OOM killer does this to a step that needs too much memory): one take-over,
    then the job stops, saying what repeated and where. Before: a spare took over after
    every death, up to 1000 times."""
    fault = "kill@backward:rank=1,step=6,restart=0;kill@backward:rank=1,step=6,restart=1"
    proc = run_disttrain(["run", *PATHS["fast"], SCRIPT, str(tmp_path), "--steps", "12"], timeout=150,
                         env=worker_env(DISTTRAIN_FAULT=fault))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 137, out[-3000:]
    assert out.count("its warm spare took over") == 1, out[-3000:]
    assert proc.stderr.rstrip().splitlines()[-1] == (
        "disttrain run: stopped: rank 1's training process died of SIGKILL at step 6 twice in a row, so a spare "
        "would die there again; not retried (exit status 137)."), out[-3000:]
    assert newest_checkpoint_is_intact(tmp_path) == 4


@pytest.mark.parametrize("action,status,how", [("kill", 137, "died of SIGKILL"), ("exit", 3, "exited with status 3")])
def test_a_death_that_repeats_at_the_same_step_stops_the_restart_path(action, status, how, tmp_path):
    """Rank 1 is killed (SIGKILL: the OOM killer, a step that needs too much memory), or
    ends with an exit status and no exception (`os._exit(3)`), at step 6 in the first
    attempt and again when the restart redoes step 6: one restart, then the job stops
    saying what repeated and where. Before: every such death was restarted until no
    restart was left."""
    code = ",code=3" if action == "exit" else ""
    fault = f"{action}@backward:rank=1,step=6,restart=0{code};{action}@backward:rank=1,step=6,restart=1{code}"
    proc = run_disttrain(["run", *PATHS["restart"], SCRIPT, str(tmp_path), "--steps", "12"], timeout=150,
                         env=worker_env(DISTTRAIN_FAULT=fault))
    out = proc.stdout + proc.stderr
    assert proc.returncode == status, out[-3000:]
    assert len((tmp_path / "starts.log").read_text().splitlines()) == 2, out[-3000:]
    assert proc.stderr.rstrip().splitlines()[-1] == (
        f"disttrain run: stopped: rank 1 {how} at step 6 in two attempts in a row, so a retry would end there "
        f"again; not retried (exit status {status})."), out[-3000:]
    assert newest_checkpoint_is_intact(tmp_path) == 4


def test_a_rank_that_lost_its_peer_is_not_listed_as_failed(tmp_path):
    """No restart left: rank 1 is killed at step 6, rank 0's next collective fails. The
    last line names rank 1 and never lists healthy rank 0 as failed (before: "also
    failed: ranks [0]", sending the user to the wrong rank)."""
    proc = run_disttrain(["run", "--nproc", "2", SCRIPT, str(tmp_path), "--steps", "12"], timeout=150,
                         env=worker_env(DISTTRAIN_FAULT="kill@backward:rank=1,step=6"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 137, out[-3000:]
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith("disttrain run: rank 1 failed first with signal SIGKILL"), last
    assert "also failed" not in last, last


def test_a_crash_report_shows_the_scripts_frames_not_the_launchers():
    """faulthandler's report cut for the console: the crashing thread's frames of the
    user's code; when that thread has no Python frames (gloo's), the main thread's."""
    from disttrain.runtime import failures

    ours = str(Path(failures.__file__).parents[1] / "launch" / "worker_entry.py")
    report = "\n".join([
        "Fatal Python error: Segmentation fault", "",
        "Thread 0x1 (most recent call first):", '  File "/x/threading.py", line 3 in wait', "",
        "Current thread 0x2 (most recent call first):",
        '  File "/u/train.py", line 9 in crash', '  File "/u/train.py", line 20 in <module>',
        '  File "<frozen runpy>", line 88 in _run_code', f'  File "{ours}", line 75 in main', "",
        "Extension modules: torch._C (total: 1)"])
    cut = failures._program_frames(report)
    assert cut.splitlines()[0] == "Fatal Python error: Segmentation fault"
    assert "train.py\", line 9 in crash" in cut and "threading" not in cut and "runpy" not in cut
    assert ours not in cut and "Extension" not in cut
    native = report.replace("Current thread 0x2 (most recent call first):\n", "Thread 0x2 (most recent call first):\n")
    native = native.replace("Thread 0x1 (most recent call first):", "Current thread 0x1 (most recent call first):")
    native = native.replace('  File "/x/threading.py", line 3 in wait\n', "")
    assert "the main thread was at" in failures._program_frames(native)
    assert "line 9 in crash" in failures._program_frames(native)


def final_weights(out: Path) -> dict:
    import torch

    return torch.load(out / "model.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def clean_loader_run(tmp_path_factory) -> Path:
    """The uninterrupted run with 2 loader workers, shared by both recovery paths."""

    def run(directory: Path) -> Path:
        proc, out = launch(directory / "clean", "restart", "--workers", "2", "--steps", "10")
        assert proc.returncode == 0, out[-3000:]
        return directory / "clean"

    return built_once(tmp_path_factory, "deaths-loader-clean", run)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_loader_worker_killed_from_outside_is_retried_bit_identically(path, clean_loader_run, tmp_path):
    """SIGKILL of one of rank 1's loader workers at step 6 (the kernel's OOM killer does
    this): the machine's, so torchrun restarts from step 4 (fast recovery: the state of
    step 6 from memory) and the run ends with the weights of an uninterrupted one.
    Before: "the program's error", not retried."""
    killed = tmp_path / "killed"
    proc, out = launch(killed, path, "--raise-at", "6", "--kind", "loaderkill", "--workers", "2", "--steps", "10")
    # fast recovery takes the newest step a rank holds: 6; 7 when the worker's death
    # reached rank 1 after step 7's gradients were reduced (rank 0 committed it); 5 when
    # it reached rank 1 while its loader fetched step 6's batch (a loaded host)
    resumed = ["resumed at step 4"] if path == "restart" else [f"resumed at step {s}" for s in (5, 6, 7)]
    assert proc.returncode == 0 and any(r in out for r in resumed), out[-3000:]
    # torch names the signal when its SIGCHLD handler sees the death first ("killed by
    # signal: Killed", the machine's); when the fetch fails first it says "exited
    # unexpectedly", which cannot be told and is retried too (the crash-loop breaker)
    assert path == "fast" or ("rank 1 lost a loader worker to a kill from outside" in out
                              or "exited unexpectedly" in out and "cannot tell whose failure" in out), out[-3000:]
    assert (killed / "loader-killed").exists()
    a, b = final_weights(killed), final_weights(clean_loader_run)
    assert a.keys() == b.keys() and all(torch_equal(a[k], b[k]) for k in a)


def torch_equal(x, y) -> bool:
    import torch

    return bool(torch.equal(x, y)) if isinstance(x, torch.Tensor) else x == y


def _table_rows() -> list[tuple[str, str]]:
    """(what ended the attempt, whose) of each row of docs/elastic.md's table."""
    text = (Path(__file__).parents[2] / "docs" / "elastic.md").read_text()
    section = text.split("## What is retried and what is not", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:4] for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    return [(what.strip(), whose.strip()) for what, whose, _ in rows[1:]]


def test_the_docs_table_of_what_is_retried_is_what_the_classifier_does():
    """Every row of docs/elastic.md "What is retried and what is not" has a case here,
    judged by runtime/failures.py as the row says: a row added, or a verdict changed,
    without the other fails this test."""
    from disttrain.errors import UserError
    from disttrain.runtime import failures

    closed = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5285")
    slow = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv")
    cases = {
        "a peer process died": failures.classify(closed).kind,
        "a collective's transport error": failures.classify(RuntimeError("NCCL error: ncclRemoteError")).kind,
        "a collective timeout while a peer is gone": failures.classify(slow, peer_gone=True).kind,
        "SIGKILL from outside": failures.classify_death(-9).kind,
        "a loader worker killed by SIGKILL": failures.classify(
            RuntimeError("DataLoader worker (pid 4121) is killed by signal: Killed.")).kind,
        "a native crash": {failures.classify_death(-s).kind for s in (11, 7, 4, 8)}.pop(),
        "an abort": failures.classify_death(-6).kind,
        "`sys.exit(n)`": failures.classify(SystemExit(3)).kind if failures.is_program_exit(SystemExit(3)) else "",
        "a `KeyboardInterrupt`": failures.PROGRAM if failures.is_program_exit(KeyboardInterrupt()) else "",
        "any other exception": failures.classify(KeyError("x")).kind,
        "`torch.OutOfMemoryError`": failures.classify(MemoryError()).kind,
        "a collective timeout with every peer alive": failures.classify(slow).kind,
        "a loader worker gone without a signal": failures.classify(
            RuntimeError("DataLoader worker (pid(s) 4121) exited unexpectedly")).kind,
        "another signal, or an exit status with no note": {failures.classify_death(c).kind for c in (-10, 3)}.pop(),
        "a hang the watchdog reports": failures.classify_death(124).kind,
        "a `UserError`": "user" if isinstance(UserError("x"), UserError) else "",
        "a rank whose code finished but whose exit is stuck": "nobody",
    }
    words = {failures.MACHINE: "the machine's", failures.PROGRAM: "the program's", failures.UNKNOWN: "cannot tell",
             "user": "the user's", "nobody": "nobody's: the code finished"}
    rows = _table_rows()
    assert len(rows) == len(cases), [what for what, _ in rows]
    for what, whose in rows:
        case = [key for key in cases if what.startswith(key)]
        assert len(case) == 1, f"no case for the row {what!r}"
        assert words[cases[case[0]]] == whose, (what, whose, cases[case[0]])
