"""An error is a witnessed failure: collective-under-rank-guard follows what each rank
class (rank 0, another node's local rank 0, the other ranks) issues through the function,
its callees, `with` bodies and a context manager's `yield`, and reports only where two
classes part, with that run as its witness. Where they pair up there is no finding.

Each script is ours, written for this suite; a comment may name the kind of public code
that showed the case.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from rule_check import PRE, findings

from disttrain.doctor.doctor_report import render_json, render_sarif

RULE = "collective-under-rank-guard"


def _hangs(src: str):
    return [f for f in findings(src, "train.py") if f.rule == RULE]


def test_rank_zero_first_in_one_function_pairs_up_and_a_lone_barrier_is_witnessed():
    # the others wait before the body, rank 0 after it: one barrier each
    paired = PRE + textwrap.dedent("""
    def prepare(folder):
        if rank != 0:
            dist.barrier()
        build_cache(folder)
        if rank == 0:
            dist.barrier()
        return folder
    """)
    assert _hangs(paired) == []
    lone = paired.replace("    if rank != 0:\n        dist.barrier()\n", "")
    [f] = _hangs(lone)
    assert f.severity == "error"
    assert f.witness.startswith("rank 0: barrier at train.py:")
    assert "ranks 1..: return at train.py:" in f.witness
    assert "-> rank 0 waits at train.py:" in f.witness


def test_rank_zero_first_through_a_context_manager_pairs_up_and_a_half_one_does_not():
    cm = PRE + textwrap.dedent("""
    from contextlib import contextmanager
    @contextmanager
    def first_on_node(local_rank):
        if local_rank not in (-1, 0):
            dist.barrier()
        yield
        if local_rank == 0:
            dist.barrier()
    def load(args):
        with first_on_node(args.local_rank):
            data = download(args.url)
        return data
    """)
    assert _hangs(cm) == []
    half = cm.replace("    if local_rank == 0:\n        dist.barrier()\n", "")
    [f] = _hangs(half)
    assert f.severity == "error"
    assert "barrier" in f.witness and "forever" in f.witness


def test_a_partner_in_the_caller_pairs_the_callee_s_barrier():
    src = PRE + textwrap.dedent("""
    def finish(path):
        if rank == 0:
            write(path)
            dist.barrier()
    def run(path):
        if rank != 0:
            dist.barrier()
        finish(path)
    """)
    assert _hangs(src) == []


def test_a_caller_that_never_reaches_the_callee_pairs_nothing_up():
    # the workers start through the launcher; the direct call is the single-process path
    src = PRE + textwrap.dedent("""
    import torch.multiprocessing as mp
    def worker(args):
        if rank == 0:
            dist.barrier()
    def main(args):
        if args.distributed:
            mp.spawn(worker, nprocs=2, args=(args,))
        else:
            worker(args)
    """)
    [f] = _hangs(src)
    assert f.severity == "error" and f.witness.startswith("rank 0: barrier")


def test_an_exit_on_rank_zero_before_a_collective_is_witnessed_and_the_mirror_image_is_not():
    src = PRE + textwrap.dedent("""
    def report(loss):
        if rank == 0:
            return loss
        dist.all_reduce(loss)
        return loss
    """)
    [f] = _hangs(src)
    assert f.severity == "error" and "rank 0: return at train.py:" in f.witness
    assert "ranks 1..: all_reduce at train.py:" in f.witness
    # every rank reduces, then only rank 0 leaves: nothing differs before the exit
    fine = PRE + textwrap.dedent("""
    def report(loss):
        dist.all_reduce(loss)
        if rank != 0:
            return None
        return loss.item()
    """)
    assert _hangs(fine) == []


def test_a_rank_compared_with_a_value_out_of_view_is_a_warning_that_says_what_it_cannot_see():
    src = PRE + textwrap.dedent("""
    def send(t, owner):
        if rank == owner.src:
            dist.barrier()
    """)
    [f] = _hangs(src)
    assert f.severity == "warning" and f.witness == ""
    assert "shows no failing run" in f.message


def test_the_witness_travels_in_json_and_sarif_and_every_error_has_one():
    sample = Path(__file__).resolve().parents[2] / "doctor_samples" / "bad_ddp.py"
    from disttrain.doctor.analyzer import analyze_paths

    files, found = analyze_paths([str(sample)])
    errors = [f for f in found if f.severity == "error"]
    assert errors and all(f.witness for f in errors)
    doc = json.loads(render_json(files, found))
    assert all(d["witness"] for d in doc["findings"] if d["severity"] == "error")
    assert all(d["witness"] is None for d in doc["findings"] if d["severity"] == "warning")
    sarif = json.loads(render_sarif(files, found))
    props = [r["properties"] for r in sarif["runs"][0]["results"] if r["level"] == "error"]
    assert props and all(p["witness"] for p in props)


# ----- calls resolved by what they are called on --------------------------------------

TRAINER = PRE + textwrap.dedent("""
from transformers import AutoTokenizer
class Trainer:
    def save_pretrained(self, folder):
        dist.barrier()
        write(folder)
class Cache:
    def flush(self):
        dist.barrier()
class Writer:
    def flush(self):
        self.buffer.clear()
    def close(self):
        if rank == 0:
            self.flush()
def main():
    trainer = Trainer()
    tokenizer = AutoTokenizer.from_pretrained("tok")
    if rank == 0:
        tokenizer.save_pretrained("out")
""")


def test_a_method_call_is_resolved_through_its_receiver_not_the_method_name():
    # the tokenizer's save_pretrained is the library's; Writer.close flushes its own buffer
    assert _hangs(TRAINER) == []
    mine = TRAINER.replace("        tokenizer.save_pretrained(\"out\")", "        trainer.save_pretrained(\"out\")")
    [f] = _hangs(mine)
    assert f.severity == "error" and "barrier at train.py:" in f.witness


# ----- advice apart from defects ---------------------------------------------------------


def test_a_launcher_preference_is_shown_only_with_advice(tmp_path, capsys):
    from disttrain.doctor import main

    script = tmp_path / "spawned.py"
    script.write_text("import torch.multiprocessing as mp\ndef worker(i):\n    pass\nmp.spawn(worker, nprocs=2)\n")
    assert main(["--format", "json", str(script)]) == 0
    assert json.loads(capsys.readouterr().out)["findings"] == []
    assert main(["--format", "json", "--advice", str(script)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(f["rule"], f["severity"]) for f in doc["findings"]] == [("mp-spawn", "advice")]
    assert doc["summary"]["advice"] == 1


# ----- ranks from other launchers' environments ------------------------------------------


def test_a_rank_read_from_slurm_or_mpi_is_proven_and_a_local_one_is_local():
    src = textwrap.dedent("""
    import datetime, os, torch, torch.distributed as dist
    rank = int(os.environ["SLURM_PROCID"])
    torch.cuda.set_device(int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]))
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    if rank == 0:
        dist.barrier()
    """)
    [f] = _hangs(src)  # SLURM's task id is a rank by data flow, not by its name alone
    assert f.severity == "error" and f.witness.startswith("rank 0: barrier")
    node_local = src.replace('rank = int(os.environ["SLURM_PROCID"])', 'rank = int(os.environ["SLURM_LOCALID"])')
    node_local = node_local.replace("    dist.barrier()", "    torch.save({}, 'c.pt')")
    saves = [f for f in findings(node_local) if f.rule == "unguarded-save"]
    assert [f.severity for f in saves] == ["warning"] and "local rank" in saves[0].message


def test_a_local_rank_argument_filled_from_horovod_is_no_cli_default():
    src = textwrap.dedent("""
    import argparse, torch
    import horovod.torch as hvd
    hvd.init()
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()
    args.local_rank = hvd.local_rank()
    torch.cuda.set_device(args.local_rank)
    """)
    assert [f for f in findings(src) if f.rule == "guard-true-on-every-rank"] == []
    left = src.replace("args.local_rank = hvd.local_rank()\n", "")
    assert [f.rule for f in findings(left) if f.rule == "guard-true-on-every-rank"] == ["guard-true-on-every-rank"]


def test_an_object_made_on_rank_zero_only_guards_as_its_rank_test_does():
    src = PRE + textwrap.dedent("""
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter("runs") if rank == 0 else None
    def log(step, loss):
        if writer is None:
            dist.barrier()
        if writer is not None:
            writer.add_scalar("loss", loss, step)
            dist.barrier()
    """)
    assert _hangs(src) == []  # the others wait first, the writer's rank after writing
    lone = src.replace("    if writer is None:\n        dist.barrier()\n", "")
    [f] = _hangs(lone)
    assert f.severity == "error" and f.witness.startswith("rank 0: barrier")
