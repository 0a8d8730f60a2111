"""Round 9's false errors (issue 26), fixed after its figures were recorded: each a small
program modelled on the held-back project where it was found. Each failed on the doctor
frozen for round 9's review (commit 8f8a27c)."""

from __future__ import annotations

from test_doctor_dataflow import PRE, found  # noqa: F401  (shared helpers)

# CodeT5's configs.py: the single-process branch names "cuda", the distributed one binds
# the device first; the two never run together
CODET5 = """
import torch
def set_dist(args):
    if args.local_rank == -1 or args.no_cuda:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        args.n_gpu = torch.cuda.device_count()
    else:
        torch.cuda.set_device(args.local_rank)
        device = torch.device("cuda", args.local_rank)
        torch.distributed.init_process_group(backend="nccl", timeout=t)
        args.n_gpu = 1
    args.device = device
set_dist(None)
"""


def test_a_cuda_use_in_the_other_branch_of_the_bind_is_not_before_it():
    assert found(CODET5, "missing-set-device") == []
    before = CODET5.replace("        torch.cuda.set_device(args.local_rank)\n",
                            "        x = torch.zeros(1).cuda()\n        torch.cuda.set_device(args.local_rank)\n")
    assert [f[0] for f in found(before, "missing-set-device")] == ["missing-set-device"]


# vall-e: the batch that ran out of memory is dumped under a name unique to the call
VALLE = PRE + """
from lhotse.utils import uuid4
def display_and_save_batch(batch, params):
    filename = f"{params.exp_dir}/batch-{uuid4()}.pt"
    torch.save(batch, filename)
display_and_save_batch(None, None)
"""


def test_a_file_named_by_uuid4_has_one_writer():
    assert found(VALLE, "unguarded-save") == []
    shared = VALLE.replace("batch-{uuid4()}.pt", "batch.pt")
    assert [f[2] for f in found(shared, "unguarded-save")] == ["error"]
