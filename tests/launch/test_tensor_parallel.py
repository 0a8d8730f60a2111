"""Tensor parallel x data parallel on 2 real gloo ranks, one launch
(tests/workers/tp_checks.py): `dt.Job(tp=2)` with FSDP and `dt.wrap(strategy="ddp",
tp=2, tp_plan=...)` against one process, sequence and loss parallel likewise, the
batches and evaluation of a TP group, a checkpoint saved at tp 2 x dp 1 loaded at tp 1 x
dp 2 and exported whole. A launch of 4 ranks runs tp 2 x dp 2 against one process (with
sequence and loss parallel too), then an epoch through changing layouts (tp 2 x dp 2,
tp 4 x dp 1), which a second launch of 2 ranks finishes (tp 1 x dp 2, tp 2 x dp 1)."""

import pytest
from conftest import built_once, launch_worker

PARITY = 1e-5
"""Max abs difference of every parameter after 6 SGD steps in fp32, global-norm
clipping at 0.5 active (the planned layers' gradients and the others' lie on different
device meshes); measured about 1e-8."""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return built_once(tmp_path_factory, "tensor_parallel2", lambda out: launch_worker("tp_checks.py", 2, out,
                                                                                      timeout=150))


@pytest.fixture(scope="module")
def grid_launch(tmp_path_factory):
    return built_once(tmp_path_factory, "tensor_parallel4",
                      lambda out: (launch_worker("tp_checks.py", 4, out, "grid", timeout=240), out))


@pytest.fixture(scope="module")
def grid(grid_launch):
    return grid_launch[0]


@pytest.fixture(scope="module")
def chain(tmp_path_factory, grid_launch):
    """Each stage's results: {stage: [rank results]} (see tests/workers/tp_checks.py)."""
    first = grid_launch[0]
    second = built_once(tmp_path_factory, "tensor_parallel_chain",
                        lambda out: launch_worker("tp_checks.py", 2, out, "chain", str(grid_launch[1]), timeout=200))
    return first, second


@pytest.mark.parametrize("sharding", ["full", "hybrid", "none", "full+sp+lp"])
def test_tp2_dp2_fsdp_matches_one_process_over_20_steps(grid, sharding):
    assert all(r[f"grid/{sharding}"] <= PARITY for r in grid)


def test_fsdp_with_tp_matches_one_process_through_the_job(ranks):
    assert all(r["job/parity"] <= PARITY for r in ranks)


def test_ranks_of_one_tp_group_read_the_same_batches_and_evaluate_together(ranks):
    seen = [r["job/seen"] for r in ranks]
    assert seen[0] == seen[1]
    assert len({i for step in seen[0] for i in step}) == 6 * 4  # no sample twice in the epoch
    assert all(r["job/eval_diff"] <= PARITY for r in ranks)


def test_one_rank_of_the_tp_group_records_its_samples(ranks):
    # The audit counts data-parallel ranks: one file, the batches the group trained.
    (name, steps), = ranks[0]["job/audit"].items()
    assert name.endswith("-rank0.jsonl") and steps == ranks[0]["job/seen"]


def test_a_user_plan_of_torch_styles_splits_only_its_layers_and_matches(ranks):
    for r in ranks:
        assert r["plain/parity"] <= PARITY and r["plain/whole"]
        assert r["plain/split"] == sorted(f"blocks.{b}.mlp.{i}.{w}" for b in (0, 1) for i in (0, 2)
                                          for w in ("weight", "bias"))


def test_a_hugging_face_llama_trains_with_its_own_plan_and_matches(ranks):
    for r in ranks:
        assert r["hf/parity"] <= PARITY
        assert r["hf/split"] == 2 * 7  # q, k, v, o, gate, up, down of each layer: on the 2D mesh


@pytest.mark.parametrize("option", ["ac", "compile", "sp", "lp"])
def test_checkpointing_compile_sequence_and_loss_parallel_compose_with_tp(ranks, option):
    assert all(r[f"option/{option}"] <= PARITY for r in ranks)
    assert all(r[f"option/{option}/left"] for r in ranks)  # no loss_parallel() left entered
    assert all(r[f"option/{option}/tied"] for r in ranks)  # the LM head's weight is still the embedding's


def test_sequence_parallel_runs_the_layers_on_a_slice_of_the_sequence(ranks):
    width = 32
    assert all(r["option/sp/block_input"] == [4, 16 // 2, width] for r in ranks)
    assert all(r["option/ac/block_input"] == [4, 16, width] for r in ranks)
    assert all(r["option/sp/logits"] == ["Tensor", [4, 16, 256]] for r in ranks)  # whole for the loss
    assert all("this batch's is 15 long; use a sequence length (block size) that divides by 2" in r["option/sp/odd"]
               for r in ranks)


def test_loss_parallel_keeps_the_logits_split_over_the_vocabulary(ranks):
    assert all(r["option/lp/logits"] == ["DTensor", [4, 16, 256 // 2]] for r in ranks)
    assert all(r["option/lp/own_context_left"] for r in ranks)  # the script's own loss_parallel() nests


def test_ranks_with_different_plans_are_refused_on_every_rank(ranks):
    assert all("ranks disagree on tensor-parallel plan" in r["plan/mismatch"] for r in ranks)


def test_checkpoint_at_tp2_loads_bit_exact_at_tp1_dp2(ranks):
    for r in ranks:
        assert r["reshard/loaded"] and r["reshard/params_equal"] and r["reshard/momenta_equal"]


def test_the_tp_checkpoint_exports_whole_tensors(ranks):
    assert ranks[0]["export/whole"]


STAGES = {1: (2, "tp 2 x dp 2"), 2: (4, "tp 4 x dp 1"), 3: (1, "tp 1 x dp 2"), 4: (2, "tp 2 x dp 1")}
"""The chain's stages: (tp, layout); 1 and 2 run on 4 ranks, 3 and 4 on 2."""


def test_an_epoch_through_four_layouts_loads_bit_exact_and_sees_every_sample_once(chain):
    first, second = chain
    samples = []
    for stage in STAGES:
        ranks = first if stage <= 2 else second
        assert all(r[f"chain/{stage}/step"] == 4 * (stage - 1) for r in ranks), stage
        assert stage == 1 or all(r[f"chain/{stage}/loaded_equal"] for r in ranks), stage  # params and momenta
        seen = [i for r in ranks for step in r[f"chain/{stage}/seen"] for i in step]
        assert len(seen) == 4 * 4, stage  # 4 steps of the global batch of 4, from one rank of each TP group
        samples += seen
    assert sorted(samples) == list(range(64))  # the epoch, each window once


def test_the_tp2_dp2_checkpoint_loads_bit_exact_at_tp1_dp4_tp1_dp2_and_tp2_dp1(chain):
    assert all(r["chain/tp1_dp4_loads_stage1"] for r in chain[0])
    assert all(r["chain/tp1_loads_stage1"] and r["chain/tp2_loads_stage1"] for r in chain[1])


def test_ckpt_verify_names_the_tensor_parallel_layout(chain):
    said = chain[0][0]["chain/verify"]
    assert ": OK (" in said and "step 4; world 4: tp 2 x dp 2, fsdp)" in said


def test_a_plan_from_the_config_splits_only_its_layers(chain):
    # stage 4's `Config(parallel=ParallelConfig(tp_plan=MLP_PLAN))`: the TOML's strings
    assert all(r["chain/4/split"] == [f"blocks.0.mlp.{i}.{w}" for i in (0, 2) for w in ("bias", "weight")]
               for r in chain[1])
    assert all("blocks.0.attn.q.weight" in r["chain/2/split"] for r in chain[0])  # the GPT's own plan at tp 4
