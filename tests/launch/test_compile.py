"""`train.compile` / `dt.wrap(compile=...)`: torch.compile per block before sharding
(torchtitan's order: activation checkpointing, compile, FSDP per block, root).

tests/workers/compile_checks.py: DDP and FSDP2 + activation checkpointing on 2 gloo
ranks with the aot_eager backend (the same Dynamo and AOTAutograd graphs, no C++
build): compile time on a small CPU is the cost of this file. Inductor's C++ kernels
are the compiler's and the machine's: `python tests/workers/compile_checks.py OUT
ddp:inductor` runs them by hand (about a minute of C++ builds on 2 cores). For each: losses within LOSS_BOUND of the
eager run's over the same steps and state-dict keys equal to eager's (no `_orig_mod.`);
for the 2-rank cases also a run stopped and rebuilt from its state dicts (compiled
again) that continues bit-identically.
Refusals are one line each and need no compile.
"""

from __future__ import annotations

import pytest
import torch
from conftest import launch_worker

import disttrain as dt
from disttrain.builtin import GPT, GPTConfig
from disttrain.errors import ConfigError
from disttrain.parallel.compile import is_compiled

LOSS_BOUND = 1e-4
"""|compiled - eager| per-step loss, fp32, 8 AdamW steps at lr 1e-2 (inductor reorders
float sums: about 1e-6 is seen; the bound leaves two orders of magnitude)."""


def _check(results: list[dict]) -> None:
    for rank in results:
        for case, r in rank.items():
            assert r["compiled"] and r["graphs"] >= 1, case
            assert r["max_diff"] <= LOSS_BOUND, (case, r["max_diff"])
            assert r["resume_identical"], case
            assert r["keys_equal"] and r["orig_mod_keys"] == [], case


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compiled_ddp_and_fsdp_on_2_ranks_match_eager_and_resume_bit_identically(tmp_path):
    _check(launch_worker("compile_checks.py", 2, tmp_path, "ddp:aot_eager,fsdp:aot_eager", timeout=280))


@pytest.mark.parametrize("options, words", [
    ({"strategy": "dp"}, "strategy 'dp'"),
    ({"strategy": "fsdp1"}, "strategy 'fsdp1'"),
    ({"strategy": "fsdp", "cpu_offload": True}, "parallel.cpu_offload"),
])
def test_unsupported_combinations_are_refused_in_one_line(options, words):
    with pytest.raises(ConfigError, match=words) as err:
        dt.wrap(GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8)), compile=True, **options)
    assert "\n" not in str(err.value) and ("train.compile = false" in str(err.value) or "one of them" in str(err.value))


def test_a_torch_compile_wrapper_is_unwrapped_and_compiled_per_block():
    model = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8))
    keys = sorted(model.state_dict())
    wrapped = dt.wrap(torch.compile(model))  # nothing is traced until a forward
    assert wrapped is model and sorted(wrapped.state_dict()) == keys
    assert all(is_compiled(b) for b in model.blocks) and model._compiled_call_impl is None
