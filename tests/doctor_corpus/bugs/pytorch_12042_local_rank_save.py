# issue: https://github.com/pytorch/pytorch/issues/12042
# summary: on several machines, checkpoints written by torch.save were corrupt (storage has wrong size); pytorch/pytorch#12370 traced it to `local_rank == 0` guards, which are not unique across nodes, so every node wrote the same file
# family: save on every rank
import argparse
import datetime

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
args = parser.parse_args()
dist.init_process_group("nccl", init_method="env://", timeout=datetime.timedelta(minutes=5))
torch.cuda.set_device(args.local_rank)


def save_checkpoint(state, is_best, filename="checkpoint.pth.tar"):
    torch.save(state, filename)  # expect: unguarded-save
    if is_best:
        torch.save(state, "model_best.pth.tar")  # expect: unguarded-save


def end_of_epoch(model, optimizer, epoch, prec1, best_prec1):
    if args.local_rank == 0:
        save_checkpoint({"epoch": epoch + 1, "state_dict": model.state_dict(), "best_prec1": best_prec1,
                         "optimizer": optimizer.state_dict()}, prec1 > best_prec1)
