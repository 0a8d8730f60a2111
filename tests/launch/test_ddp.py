"""DDP, accumulation and global metrics against single-process references, on real
gloo ranks under torchrun (P-DDP-2,3,4,5, P-LOOP-1)."""

import pytest
from conftest import built_once, launch_worker


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request, tmp_path_factory):
    return request.param, built_once(tmp_path_factory, f"ddp{request.param}",
                                     lambda out: launch_worker("ddp_checks.py", request.param, out))


def test_ddp_parity_with_one_process_P_DDP_2(ranks):
    _, results = ranks
    for res in results:
        assert res["parity_mlp"] <= 1e-6
        assert res["parity_gpt"] <= 1e-6


def test_accumulation_equals_one_big_step_P_DDP_5(ranks):
    for res in ranks[1]:
        assert res["accum_diff"] <= 1e-6
        assert res["short_window_diff"] <= 1e-6


def test_no_sync_allreduces_once_per_optimizer_step_P_DDP_5(ranks):
    for res in ranks[1]:
        # A tiny MLP fits one 25 MB bucket: one all-reduce per optimizer step, none in no_sync.
        assert res["accum_optimizer_steps"] == 5
        assert res["accum_allreduce_calls"] == 5


def test_global_mean_with_unequal_counts_P_LOOP_1(ranks):
    for res in ranks[1]:
        assert res["global_mean"] == pytest.approx(res["global_mean_expected"], abs=1e-12)


def test_accum_steps_mismatch_is_named_on_every_rank(ranks):
    world, results = ranks
    for res in results:
        msg = res["accum_mismatch"]
        assert msg and "accum_steps" in msg and "rank 0: 2" in msg and f"rank {world - 1}: 4" in msg


def test_unused_parameter_error_explains_cause_and_fixes_P_DDP_4(ranks):
    for res in ranks[1]:
        msg = res["unused_error"]
        assert msg and "find_unused_parameters" in msg and "requires_grad=False" in msg
