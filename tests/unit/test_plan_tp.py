"""`disttrain plan`'s tensor-parallel rows against numbers worked out by hand.

The model: the built-in GPT with vocab 16, context 4, one block of width 8, 2 heads,
MLP width 32, biases on. Its parameters, in order, are tok_emb 16x8, pos_emb 4x8, the
block (ln1 8+8, q/k/v 8x8+8 each, proj 8x8+8, ln2 8+8, mlp.0 32x8+32, mlp.2 8x32+8:
872 values) and ln_f 8+8: 1048 values in 20 tensors. At tp 2 the plan halves q, k, v
and mlp.0 (weights and biases, by rows of the weight) and the weights of proj and
mlp.2 (by columns; their biases stay whole): the block keeps 460 values, the model 636.
The real ranks' bytes are checked in tests/launch/test_plan.py.
"""

import json

import pytest

from disttrain.errors import UserError
from disttrain.plan import estimate, main

SPEC = "vocab_size=16,block_size=4,n_layer=1,n_head=2,n_embd=8"
B, T = 2, 4  # batch per TP group, sequence: 8 tokens


def plan(**kw):
    return estimate(SPEC, **{"devices": 4, "batch_per_device": B, "seq_len": T, **kw})


def test_degrees_divide_the_heads_and_tp1_is_fsdp_full():
    p = plan()
    assert [r.tp for r in p.tp_rows] == [1, 2]  # 2 heads: no tp 4
    one, full = p.get_tp(1), p.get("fsdp_full")
    assert (one.total, one.comm_bytes) == (full.total, full.comm_bytes)


def test_tp2_dp2_memory_by_hand():
    r = plan().get_tp(2)
    # each dp rank holds half of every TP-local tensor's rows (all even here): 318 values
    assert r.params == r.grads == 4 * 318
    assert r.optim == 8 * 318 + 4 * 20  # AdamW's two moments, and a step per tensor
    # per token: 4 h whole (the norms' inputs and outputs) + (5 h + 2 f) / tp split (q, k,
    # v, attention output and its copy; the MLP's hidden values) = 32 + 104 / 2 = 84 values;
    # the LM head: 2 h + vocab x (logits + fp32 log-softmax)
    assert r.activations == 8 * 4 * 84 + 8 * (4 * 2 * 8 + 16 * 8)
    # FSDP full: root (176) + two blocks (460 each) gathered, a block's grads and fp32 input
    assert r.buffers == 4 * (176 + 2 * 460) + 2 * 4 * 460
    assert r.total == 2 * 4 * 318 + r.optim + r.activations + r.buffers


def test_tp2_dp2_communication_by_hand():
    parts = plan().get_tp(2).comm_parts
    # ring all-reduce over 2 ranks sends 2 (2 - 1) / 2 = 1x the tensor: 8 tokens x width x 4 B
    assert parts["tp all-reduce fwd x2/block"] == 8 * (8 + 8) * 4  # proj and mlp.2 outputs
    assert parts["tp all-reduce bwd x4/block"] == 8 * (4 * 8) * 4  # q, k, v, mlp.0 input grads
    # FSDP over 2 dp ranks of the 636 local values: half of them per collective
    assert parts["dp all-gather params x2"] == 2 * 318 * 4
    assert parts["dp reduce-scatter grads"] == 318 * 4


def test_megatron_layout_of_a_bare_count_all_reduces_twice_per_block_each_way():
    p = estimate(1.3e9, devices=8, batch_per_device=1, seq_len=1024, precision="bf16")  # 16 heads
    r, h, layers = p.get_tp(8), p.model.hidden, p.model.n_layer
    per_phase = 2 * 7 / 8 * 1024 * 2 * h * layers * 2  # two all-reduces of b s h bf16 per block
    assert r.comm_parts["tp all-reduce fwd x2/block"] == pytest.approx(per_phase, rel=1e-9)
    assert r.comm_parts["tp all-reduce bwd x2/block"] == pytest.approx(per_phase, rel=1e-9)
    split = 12 * h * h * layers  # the blocks' four matrices are split, the rest is whole
    assert r.params == 4 * (1.3e9 - split + split / 8)


def test_recommends_the_smallest_degree_that_fits_or_says_none_does():
    p = plan()
    one, two = p.get_tp(1).total, p.get_tp(2).total
    assert two < one
    assert plan(device_mem=one * 2).tp_recommended == 1
    between = plan(device_mem=(one + two) / 2 / 0.9)
    assert between.tp_recommended == 2 and "smallest degree that fits" in between.tp_reason
    none = plan(device_mem=two * 0.5)
    assert none.tp_recommended is None and "no TP degree fits" in none.tp_reason


def test_a_degree_that_cuts_a_head_or_needs_fp8_is_refused_by_name():
    with pytest.raises(UserError, match=r"--tp 4 .* use one of \[1, 2\]"):
        plan(tp=4)
    with pytest.raises(UserError, match="fp8"):
        plan(tp=2, precision="fp8")
    assert plan(tp=1, precision="fp8").tp_rows == []  # no TP asked for: nothing to refuse


def test_the_toml_and_the_flags_give_the_same_rows(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    model = SPEC.replace(",", "\n")
    toml.write_text(f"[model]\n{model}\n[train]\nbatch_size = {B}\n[parallel]\nnproc = 4\ntp = 2\n")
    assert main(["--gpt", str(toml), "--seq-len", str(T), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    want = plan(tp=2)
    assert data["tp"] == 2 and data["lr"]["world"] == 2  # the LR counts the dp ranks
    assert [(r["tp"], r["total"], r["comm_bytes"]) for r in data["tp_rows"]] == [
        (r.tp, r.total, r.comm_bytes) for r in want.tp_rows
    ]
    assert main(["--gpt", SPEC, "--devices", "4", "--batch", str(B), "--seq-len", str(T), "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "tp 2 x dp 2" in out and "asked for tp 2" in out
