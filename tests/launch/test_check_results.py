"""`disttrain run --check`: what a run reports and keeps -- a number printed on rank 0
from its shard only, checkpoints (one file from several ranks, a DDP wrapper's
`module.` keys, every rank restoring one rank's RNG state) and float16 training (no
loss scaler, a GradScaler that skips on some ranks only). docs/check.md.

tests/workers/check_scripts/results.py holds every bug behind a flag and the correct
form by default. The four warnings and the shared file are shown by one run (the
warnings come first, the stop at the same step ends it); the scaler's skip by another;
the correct twin runs silent and ends bit-identical to a run without --check. Each job
is 2 gloo ranks, 8 steps, under a subprocess timeout. The verdicts' edges are tested in
process, on the numbers every rank would gather.
"""

import subprocess

import torch
from conftest import WORKERS, run_checked, script_line

from disttrain.check import float16, numbers, rng_restore
from disttrain.check.patches import Patches
from disttrain.check.saves import SaveWatch, prefixed

SCRIPT = WORKERS / "check_scripts" / "results.py"
JOB_TIMEOUT = 120


def line_of(text: str) -> str:
    return script_line(SCRIPT, text)


def run_script(out, *args: str, check: tuple[str, ...] = ("--check",)) -> subprocess.CompletedProcess:
    return run_checked(SCRIPT, str(out), *args, check=check, timeout=JOB_TIMEOUT)


def assert_said(stderr: str, words: list[str], lines: list[str]) -> None:
    for text in [*words, *(line_of(line) for line in lines)]:
        assert text in stderr, (text, stderr[-4000:])


def assert_one_stop(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stderr.count("--check stopped the run") == 1 and "Traceback" not in proc.stderr
    assert "(exit status 3)" in proc.stderr


def test_warnings_for_numbers_keys_and_rng_then_a_stop_for_one_file_from_two_ranks(tmp_path):
    proc = run_script(tmp_path, "--bug", "local_metric,module_keys,rng_shared,fp16_no_scaler,shared_file")
    assert_one_stop(proc)
    err = proc.stderr
    assert err.count("disttrain --check warning:") == 4, err[-4000:]
    # every rank restored rank 0's RNG file, though each was seeded its own
    assert_said(err, ["is the same on all 2 ranks", "every rank loaded one rank's RNG state",
                      "f'rng_rank{rank}.pt'"], ["torch.set_rng_state("])
    # float16 autocast, no GradScaler: the measured share of zero gradients
    assert_said(err, ["step 1: training in float16", "without a loss scaler",
                      "% of the gradient values are exactly zero", "torch.amp.GradScaler"],
                ["* LOSS_WEIGHT", "optimizer.step()"])
    # rank 0 printed its own shard's loss, no all_reduce
    assert_said(err, ["is rank 0's shard only", "val_loss", "the evaluation after step 4", "all_reduce both"],
                ['print(f"epoch {epoch}: val_loss', 'reduction="sum"'])
    # the DDP wrapper's state_dict saved
    assert_said(err, ["every key starting with `module.`", "model.module.state_dict()"],
                ['torch.save(state, os.path.join(args.out, "ckpt.pt"))'])
    # ...and both ranks wrote ckpt.pt: the stop
    assert_said(err, ["stopped the run: ranks 0, 1 each wrote the file", "ckpt.pt", "save on one rank only",
                      "torch.distributed.checkpoint"], ['torch.save(state, os.path.join(args.out, "ckpt.pt"))'])


def test_a_scaler_skip_that_differs_across_ranks_stops_before_the_ranks_part(tmp_path):
    proc = run_script(tmp_path, "--bug", "scaler_skip")
    assert_one_stop(proc)
    assert_said(proc.stderr, ["step 2: GradScaler found inf/NaN gradients on rank 1 and none on rank 0",
                              "rank 0 takes the step and rank 1 skips it", "average the gradients first"],
                ["scaler.step(optimizer)", "scaler.unscale_(optimizer)"])


def test_the_correct_twin_runs_silent_and_ends_bit_identical_without_check(tmp_path):
    (tmp_path / "checked").mkdir()
    (tmp_path / "plain").mkdir()
    checked = run_script(tmp_path / "checked")
    plain = run_script(tmp_path / "plain", check=())
    assert (checked.returncode, plain.returncode) == (0, 0), checked.stderr[-3000:] + plain.stderr[-3000:]
    assert "warning" not in checked.stderr and "stopped" not in checked.stderr, checked.stderr
    assert "checked 8 optimizer steps and an epoch boundary on 2 ranks" in checked.stderr
    assert ("results: compared across ranks: 2 evaluations, 5 torch.save calls, 1 RNG restore, "
            "8 GradScaler steps") in checked.stderr, checked.stderr
    assert "no problem found" in checked.stderr and "--check" not in plain.stderr
    ours, theirs = torch.load(tmp_path / "checked" / "params.pt"), torch.load(tmp_path / "plain" / "params.pt")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def evaluation(first, printed=("eval.py:9", "val 0.52", False)):
    return {"after_step": 4, "line": "eval.py:5", "first": first, "printed": printed}


def test_a_printed_number_is_flagged_only_when_the_shards_differ_and_nothing_combined_them():
    shard = [[evaluation((1.0, 2.0))], [evaluation((3.0, 4.0), printed=None)]]
    (key, finding), = numbers.judge(shard)
    assert key == "numbers" and not finding.stops and "eval.py:9" in finding.text and "eval.py:5" in finding.text
    same_data = [[evaluation((1.0, 2.0))], [evaluation((1.0, 2.0), printed=None)]]
    reduced = [[evaluation((1.0, 2.0), printed=("eval.py:9", "val 0.52", True))], [evaluation((3.0, 4.0))]]
    rank0_alone = [[evaluation((1.0, 2.0))], []]
    no_number = [[evaluation((1.0, 2.0), printed=None)], [evaluation((3.0, 4.0), printed=None)]]
    for rows in (same_data, reduced, rank0_alone, no_number):
        assert numbers.judge(rows) == []
    assert numbers.NUMBER.search("val_loss 0.5234") and numbers.NUMBER.search("acc 87 %")
    assert not numbers.NUMBER.search("epoch 3 step 120: evaluating")


def test_saves_compare_paths_per_host_and_see_a_wrappers_keys():
    def save(host, path="/ckpt/last.pt"):
        return {"path": path, "resolved": path, "host": host, "line": "s.py:3", "prefixed": False}

    watch = SaveWatch()
    assert watch.judge([[save("node-a")], [save("node-b")]]) == []  # each node's own disk, maybe
    assert watch.judge([[save("node-a"), save("node-a")], []]) == []  # one rank, twice
    (key, finding), = watch.judge([[], [], [save("node-a")]])  # rank 2 writes rank 0's file later
    assert key == "saves-shared" and finding.stops and "ranks 0, 2 each wrote the file /ckpt/last.pt" in finding.text
    weights = torch.zeros(2)
    assert prefixed({"module.0.weight": weights}) and prefixed({"model": {"module.w": weights}, "step": 3})
    assert not prefixed({"0.weight": weights, "module.x": weights}) and not prefixed({})


def test_an_rng_restore_is_flagged_only_when_per_rank_states_became_one():
    shared = [{"torch.set_rng_state": ("a", "x", "r.py:4")}, {"torch.set_rng_state": ("b", "x", "r.py:4")}]
    assert rng_restore.judge(shared)[0][0] == "rng"
    seeded_alike = [{"torch.set_rng_state": ("a", "x", None)}, {"torch.set_rng_state": ("a", "x", None)}]
    own_files = [{"torch.set_rng_state": ("a", "x", None)}, {"torch.set_rng_state": ("b", "y", None)}]
    one_rank = [{"torch.set_rng_state": ("a", "x", None)}, {}]
    for rows in (seeded_alike, own_files, one_rank):
        assert rng_restore.judge(rows) == []
    assert rng_restore.digest(torch.get_rng_state()) == rng_restore.digest(torch.get_rng_state().clone())


def test_float16_overflow_without_a_scaler_stops_and_cpu_autocast_is_seen():
    measured = [{"line": "t.py:7", "total": 100, "zeros": 10, "bad": 0},
                {"line": "t.py:7", "total": 100, "zeros": 5, "bad": 40}]
    (key, finding), = float16.judge(measured, 3, "t.py:9")
    assert key == "precision-fp16-bad" and finding.stops
    assert "40.0% of the gradient values are inf or NaN on rank 1" in finding.text
    assert float16.judge([None, None], 3, None) == []
    with torch.autocast("cpu", dtype=torch.float16):
        assert float16.fp16_autocast()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not float16.fp16_autocast()


def test_patches_put_back_only_what_is_still_ours():
    class Owner:
        @staticmethod
        def f():
            return "original"

    first, later = Patches(), Patches()
    first.wrap(Owner, "f", lambda original: lambda: "ours")
    later.wrap(Owner, "f", lambda original: lambda: f"theirs over {original()}")
    first.restore()  # someone wrapped after us: ours stays in their chain
    assert Owner.f() == "theirs over ours"
    later.restore()
    assert Owner.f() == "ours"
