"""the analysis the rules stand on: exclusive branches and one-process-per-node tests.

Each test is a small script written for this suite: the pitfall the rule must flag, or a
look-alike it must leave alone. A comment may name the public project whose review
showed the case (a fact); the code is ours.
"""

from __future__ import annotations

import ast
import textwrap

from rule_check import found

from disttrain.doctor import control_flow
from disttrain.doctor.analyzer import parse
from disttrain.doctor.dataflow import Project
from disttrain.doctor.facts import Facts


def test_is_local_main_process_is_one_process_per_node():
    facts = parse("s.py", textwrap.dedent("""
        if accelerator.is_local_main_process:
            pass
        if accelerator.is_main_process:
            pass
        """))
    facts.others = []
    facts.__dict__["project"] = Project([facts])
    tests = [n.test for n in ast.walk(facts.tree) if isinstance(n, ast.If)]
    assert [control_flow.guard_kind(facts, t) for t in tests] == ["local", "global"]


def test_exclusive_helper_on_if_elif_else_chains():
    src = "if a:\n    x = 1\nelif b:\n    y = 2\nelse:\n    z = 3\nw = 4\nif c:\n    v = 5\n"
    facts = Facts.parse("s.py", src)
    stmt = {n.targets[0].id: n for n in facts.nodes if isinstance(n, ast.Assign)}
    assert facts.exclusive(stmt["x"], stmt["y"]) and facts.exclusive(stmt["y"], stmt["z"])
    assert facts.exclusive(stmt["z"], stmt["x"])
    assert not facts.exclusive(stmt["x"], stmt["w"]) and not facts.exclusive(stmt["x"], stmt["v"])
    assert not facts.exclusive(stmt["x"], stmt["x"])



def test_a_negated_string_constant_is_read_as_no_number():
    """`default=-"1"` and `== -"2"` are no numbers: the doctor reads them as unknown values
    and checks the rest (negating the string raised TypeError and stopped the whole run)."""
    out = found("""
        import argparse
        import torch
        import torch.distributed as dist
        p = argparse.ArgumentParser()
        p.add_argument("--local_rank", type=int, default=-"1")
        args = p.parse_args()
        dist.init_process_group("nccl")
        if dist.get_world_size() == -"2":
            dist.barrier()
        x = torch.zeros(1).cuda()
        """)
    assert ("missing-set-device", 11, "error") in out
