"""`disttrain run --check`: bugs that only show when a script runs, found in the user's
unchanged script (docs/check.md; P-DDP-2,3, P-DATA-1,2, P-FSDP-7).

Every bug of tests/workers/check_scripts/train.py has a correct twin: the bug stops the
run with exit 3 (a warning for the order of the data) and one message naming it, the
step and the script's line; the twin runs silent, and its summary says what was checked.
Each job is 2 gloo ranks, 8 steps, under a subprocess timeout.
"""

import subprocess

import pytest
import torch
from conftest import WORKERS, run_checked, run_cmd, script_line, worker_env

from disttrain.check.settings import ALL, CHECK_ENV, parse_steps, take_check_flags, window_from_env
from disttrain.errors import UserError
from disttrain.launch import run_command as launch
from disttrain.launch.run_help import help_text

SCRIPT = WORKERS / "check_scripts" / "train.py"
JOB_TIMEOUT = 120


def line_of(text: str) -> str:
    return script_line(SCRIPT, text)


def run_script(out, *args: str, check: tuple[str, ...] = ("--check",)) -> subprocess.CompletedProcess:
    return run_checked(SCRIPT, str(out), *args, check=check, timeout=JOB_TIMEOUT)


def test_flags_become_the_ranks_window_and_leave_torchruns_arguments():
    assert take_check_flags(["--nproc", "2"]) == (["--nproc", "2"], {})
    assert take_check_flags(["--check", "--nproc", "2"]) == (["--nproc", "2"], {CHECK_ENV: "50"})
    assert take_check_flags(["--check-steps", "all"]) == ([], {CHECK_ENV: "all"})
    assert take_check_flags(["--check", "--check-steps=7"]) == ([], {CHECK_ENV: "7"})
    assert (parse_steps("all"), parse_steps("3")) == (ALL, 3)
    assert window_from_env({CHECK_ENV: "all"}) == ALL and window_from_env({}) is None
    for bad in (["--check-steps", "0"], ["--check-steps", "x"], ["--check-steps"]):
        with pytest.raises(UserError, match="--check-steps"):
            take_check_flags(bad)
    run = launch.torchrun_for(["--nproc", "2", "--check-steps", "5", str(SCRIPT), "out", "--check"])
    assert run.env[CHECK_ENV] == "5" and "--check-steps" not in run.args
    assert run.args[-2:] == ["out", "--check"]  # the script's own arguments pass untouched
    assert CHECK_ENV not in launch.torchrun_for(["--nproc", "2", str(SCRIPT)]).env
    assert "--check " in help_text() and "--check-steps N" in help_text()


BUGS = {
    # bug flags -> (exit status, the words of the message, the lines it names)
    "bypass": (
        ("--bug", "bypass"),
        3,
        ["gradients of `0.weight` differ across ranks", "rank 1 differs from rank 0", "`.module` directly"],
        ["forward(x), y)", "optimizer.step()"],
    ),
    "rank_init": (
        ("--strategy", "manual", "--bug", "rank_init"),
        3,
        ["parameter `0.weight` differs across ranks", "initialised differently on each rank", "torch.manual_seed"],
        ["optimizer.step()"],
    ),
    "no_sampler": (
        ("--bug", "no_sampler"),
        3,
        ["every rank got the same first batch", "DistributedSampler(dataset)"],
        ["for i, (x, y) in enumerate(loader)"],
    ),
    "opt_first": (
        ("--strategy", "fsdp2", "--bug", "opt_first"),
        3,
        ["none of the 4 parameters of the optimizer", "built before fully_shard", "never trains"],
        ["optimizer.step()"],
    ),
    "sampler_seed": (
        ("--bug", "sampler_seed"),
        3,
        ["ranks 0 and 1 trained on", "of the same samples in epoch 1", "seed=3; rank 1", "the seeds differ"],
        ["for i, (x, y) in enumerate(loader)"],
    ),
    "split_twice": (
        ("--bug", "split_twice"),
        3,
        ["already a different slice on each rank", "other indices", "the data is split twice", "50%"],
        ["for i, (x, y) in enumerate(loader)"],
    ),
    "no_zero_grad": (
        ("--bug", "no_zero_grad"),
        3,
        ["step 2: optimizer.step()", "still held those of the step before (4 of 4", "optimizer.zero_grad()"],
        ["optimizer.step()"],
    ),
    "unused": (
        ("--bug", "unused"),
        3,
        ["step 1: the parameter `spare.weight` (and 1 more) got no gradient", "find_unused_parameters=True"],
        ["optimizer.step()"],
    ),
    "one_class": (
        ("--bug", "one_class"),
        3,
        ["steps 1-3: every gradient of the optimizer's 4 parameters was exactly zero", "cross_entropy over a single"],
        ["optimizer.step()"],
    ),
    "warnings": (  # two warnings in one run, each said once, and the run goes on
        ("--bug", "accum_no_sync,no_set_epoch"),
        0,
        ["warning: step 1: 2 forwards through DistributedDataParallel", "model.no_sync()", "warning: epoch 2",
         "1 extra all-reduce of 644 bytes each, 644 bytes more traffic per step",
         "replays the same order", "sampler.set_epoch(epoch)", "2 warnings above"],
        ["forward(x[:half])", "for i, (x, y) in enumerate(loader)"],
    ),
}


WINDOWS = {"warnings": ("--check-steps", "2")}
"""A window that ends before the epoch boundary: the boundary is still checked."""


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_bug_is_named_with_its_step_line_and_fix(bug, tmp_path):
    args, status, words, lines = BUGS[bug]
    proc = run_script(tmp_path, *args, check=WINDOWS.get(bug, ("--check",)))
    assert proc.returncode == status, proc.stderr[-3000:]
    for text in [*words, *(line_of(line) for line in lines)]:
        assert text in proc.stderr, (text, proc.stderr[-3000:])
    if status == 3:  # one message, from the launcher, and no traceback
        assert proc.stderr.count("--check stopped the run") == 1 and "Traceback" not in proc.stderr
        assert "(exit status 3)" in proc.stderr


@pytest.mark.parametrize("strategy", ["manual", "fsdp2"])
def test_a_correct_twin_runs_silent_and_says_what_was_checked(strategy, tmp_path):
    proc = run_script(tmp_path, "--strategy", strategy, check=("--check-steps", "all"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning" not in proc.stderr and "stopped" not in proc.stderr, proc.stderr
    assert "checked 8 optimizer steps and an epoch boundary on 2 ranks" in proc.stderr, proc.stderr
    assert "no problem found" in proc.stderr
    expected = "identical on every rank" if strategy == "manual" else "sharded parameters (DTensor)"
    assert expected in proc.stderr, proc.stderr


def test_checks_change_no_number_of_the_run(tmp_path):
    """The DDP twin with --check and without ends with bit-identical parameters."""
    (tmp_path / "checked").mkdir()
    (tmp_path / "plain").mkdir()
    checked = run_script(tmp_path / "checked")
    plain = run_script(tmp_path / "plain", check=())
    assert (checked.returncode, plain.returncode) == (0, 0), checked.stderr[-3000:] + plain.stderr[-3000:]
    assert "no problem found" in checked.stderr and "DDP averages the gradients" in checked.stderr
    assert "2 micro-batches per step, no_sync() on all but the last" in checked.stderr
    assert "warning" not in checked.stderr and "--check" not in plain.stderr
    ours, theirs = torch.load(tmp_path / "checked" / "params.pt"), torch.load(tmp_path / "plain" / "params.pt")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


JOB_SCRIPT = WORKERS / "check_scripts" / "job_edit.py"


@pytest.mark.parametrize("bug", ["edit", "one_rank"])
def test_job_check_true_finds_the_scripts_own_bugs(bug, tmp_path):
    """`dt.Job(check=True)` under a plain `disttrain run`: a parameter changed outside the
    optimizer, a collective on rank 0 only. (A Job's correct twin runs silent in
    `test_disttrain_train_guard_check_runs_the_checks`: the trainer drives a Job.)"""
    cmd = run_cmd(2, str(JOB_SCRIPT), str(tmp_path), "--bug", bug)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT, env=worker_env())
    lines = JOB_SCRIPT.read_text().splitlines()
    if bug == "edit":
        assert proc.returncode == 3, proc.stderr[-3000:]
        # the Job steps the optimizer when the loop asks for the next batch: step 3's, after the edit
        step_line = next(i for i, line in enumerate(lines, 1) if "in job.steps(" in line)
        for text in ("step 3: the parameter `0.bias` differs across ranks", "changed outside the optimizer",
                     f"job_edit.py:{step_line}"):
            assert text in proc.stderr, (text, proc.stderr[-3000:])
    elif bug == "one_rank":
        assert proc.returncode == 3, proc.stderr[-3000:]
        reduce_line = next(i for i, line in enumerate(lines, 1) if "all_reduce(loss" in line)
        for text in ("rank 0 calls all_reduce", f"job_edit.py:{reduce_line}", "runs on rank 0 only"):
            assert text in proc.stderr, (text, proc.stderr[-3000:])
        assert proc.stderr.count("--check stopped the run") == 1 and "Traceback" not in proc.stderr


def test_guard_check_steps_is_validated():
    from disttrain.config import Config
    from disttrain.config.schema import validate

    cfg = Config()
    cfg.guard.check, cfg.guard.check_steps = True, 0
    with pytest.raises(UserError, match="guard.check_steps is 0"):
        validate(cfg)
    cfg.guard.check_steps = -1
    validate(cfg)


def test_disttrain_train_guard_check_runs_the_checks(tmp_path):
    """`[guard] check = true` reaches the trainer's Job: the summary of a tiny run."""
    from conftest import ROOT, run_disttrain

    proc = run_disttrain(["train", str(ROOT / "examples" / "tiny_gpt.toml"), "--train.steps=3",
                          "--model.n_layer=1", "--model.n_embd=32", "--model.block_size=32",
                          "--data.max_bytes=100000", f"--train.out_dir={tmp_path}", "--train.eval_every=0",
                          "--guard.check=true"], timeout=JOB_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "disttrain --check: checked 3 optimizer steps on 2 ranks" in proc.stderr, proc.stderr[-3000:]
    assert "DDP averages the gradients" in proc.stderr and "no problem found" in proc.stderr
