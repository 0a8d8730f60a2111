"""Code no run executes: findings there would describe runs that cannot happen.

Each test is a small script written for this suite: the dead code the doctor must leave
alone, beside a look-alike that runs and stays reported. A comment may name the public
project whose review showed the case (a fact); the code is ours.
"""

from __future__ import annotations

from rule_check import PRE, found, found_in

SAVES = ("unguarded-save", "non-atomic-save")


def test_a_branch_under_a_test_false_whatever_the_values_never_runs():
    # OpenPCDet: a separate optimizer file written under `if False and ...`
    src = PRE + "def keep(state, name):\n    if False and 'opt' in state:\n        torch.save(state, name)\n"
    assert found(src, "non-atomic-save") == []
    runs = src.replace("if False and", "if not False and")
    assert found(runs, "non-atomic-save") == [("non-atomic-save", 13, "warning")]


def test_only_the_last_definition_of_a_function_is_ever_called():
    # RepVGG: load_checkpoint defined twice in one module
    src = PRE + (
        "def restore(path):\n    return torch.load(path)\n"
        "def restore(path):\n    return torch.load(path, map_location='cpu', weights_only=True)\n"
        "restore('c.pt')\n"
    )
    assert found(src, "load-without-weights-only") == []
    # read between the two definitions: the first one runs at import time
    used = src.replace("def restore(path):\n    return torch.load(path, ", "warm = restore('w.pt')\n"
                       "def restore(path):\n    return torch.load(path, ")
    assert found(used, "load-without-weights-only") == [("load-without-weights-only", 12, "warning")]


# RepVGG: the validation loader comes from a helper that always builds one, and the
# `else` of `if val_loader is not None:` saves on every rank
NEVER_NONE_HELPER = """
import torch
def build_set(train):
    if train:
        data = TrainSet()
    else:
        data = EvalSet()
    return data, 10
def build_loaders(cfg):
    train_set, classes = build_set(True)
    val_set, _ = build_set(False)
    if val_set is None:
        val_loader = None
    else:
        val_loader = torch.utils.data.DataLoader(val_set)
    return torch.utils.data.DataLoader(train_set), val_loader, classes
"""

NEVER_NONE_MAIN = """
import datetime, os
import torch
import torch.distributed as dist
from data import build_loaders
def main(cfg, model):
    train_loader, val_loader, classes = build_loaders(cfg)
    for epoch in range(3):
        if val_loader is not None:
            evaluate(model, val_loader)
        else:
            torch.save(model.state_dict(), "last.pt")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
main(None, None)
"""


def test_a_branch_taken_only_when_a_never_none_value_is_none_never_runs(tmp_path):
    files = {"data/build.py": NEVER_NONE_HELPER, "main.py": NEVER_NONE_MAIN}
    assert [f for f in found_in(tmp_path / "a", files) if f[1] in SAVES] == []
    # the look-alike: the helper hands back None when the config asks for no validation
    maybe = NEVER_NONE_HELPER.replace("    if val_set is None:", "    if val_set is None or not cfg.val:")
    got = found_in(tmp_path / "b", {"data/build.py": maybe, "main.py": NEVER_NONE_MAIN})
    assert sorted((f[1], f[2], f[3]) for f in got if f[1] in SAVES) == [
        ("non-atomic-save", 12, "warning"),
        ("unguarded-save", 12, "error"),
    ]
    # a capitalised name is a constructor only when it is no project function (this may be None)
    factory = NEVER_NONE_HELPER + "def EvalSet():\n    return None\n"
    got = found_in(tmp_path / "c", {"data/build.py": factory, "main.py": NEVER_NONE_MAIN}, "unguarded-save")
    assert [(f[2], f[3]) for f in got] == [(12, "error")]
