"""Issue 43's measure of the call chain, by `python -m bench.call_chain` (a real, tiny
`disttrain train` run on 2 CPU ranks): in a worker, the disttrain files from its entry
module to `optimizer.step()`; in the launcher, from cli.py to torchrun's start of a
worker."""

from __future__ import annotations

import pytest
from conftest import built_once

from bench.call_chain import chain, measure


@pytest.fixture(scope="module")
def chains(tmp_path_factory) -> dict[str, list[str]]:
    # Once per test session: each test worker that runs one of these tests would run it again.
    return built_once(tmp_path_factory, "call-chain", lambda _: measure(timeout=300))


def test_the_worker_reaches_the_optimizer_step_in_at_most_4_files(chains):
    assert chains["worker"][0] == "train/__main__.py" and chains["worker"][-1] == "train/accumulation.py"
    assert len(chains["worker"]) <= 4, chains["worker"]


def test_the_launcher_reaches_torchrun_in_at_most_3_files(chains):
    assert chains["launcher"][0] == "cli.py"
    assert len(chains["launcher"]) <= 3, chains["launcher"]


def test_a_chain_keeps_the_package_files_once_in_order(tmp_path):
    pkg = tmp_path / "disttrain"
    stack = ["/usr/lib/python3.11/runpy.py", f"{pkg}/cli.py", f"{pkg}/cli.py", "/x/torch/nn/module.py",
             f"{pkg}/train/job.py", f"{pkg}/cli.py"]
    assert chain(stack, pkg) == ["cli.py", "train/job.py"]
