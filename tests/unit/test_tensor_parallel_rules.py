"""Tensor-parallel degrees and plans that cannot work are one error before any rank
starts (config validation) or before the model changes (the plan's checks)."""

import json
from types import SimpleNamespace

import pytest
import torch.nn as nn
from conftest import checkpoint_copy
from torch.distributed.tensor.parallel import ColwiseParallel

from disttrain.builtin import GPT, GPTConfig
from disttrain.checkpoint import ckpt_command
from disttrain.config import load_config
from disttrain.config.tp_rules import dp_coordinates
from disttrain.errors import ConfigError, UserError
from disttrain.parallel.mesh import Layout
from disttrain.parallel.tensor_parallel import check_plan, resolve_plan

TINY = GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=16)


FSDP = "--parallel.strategy=\"fsdp\""


@pytest.mark.parametrize("overrides, expected", [
    ([FSDP, "--parallel.tp=3", "--parallel.nproc=4"], "does not divide the world of 4 ranks; use one of [1, 2, 4]"),
    ([FSDP, "--parallel.tp=4", "--parallel.nproc=4", "--model.n_head=2"],
     "2 heads (model.n_head) into whole heads per rank; use one of [1, 2]"),
    (["--parallel.tp=2", "--parallel.nproc=4"], "use --parallel.strategy=fsdp"),  # ddp with replicas
    (["--parallel.tp=2", "--parallel.strategy=\"zero1\""], "not 'zero1'"),
    ([FSDP, "--parallel.tp=2", "--parallel.nproc=6", "--parallel.sharding=\"hybrid\"",
      "--parallel.shard_group_size=2"], "does not divide the world of 3 ranks"),  # the data-parallel world
    (["--parallel.tp=0"], "'parallel.tp' is 0"),
    (["--parallel.sequence_parallel=true"], "parallel.sequence_parallel = true splits over the tensor-parallel "
                                            "group, but parallel.tp is 1"),
    (["--parallel.loss_parallel=true"], "set parallel.tp to 2 or more, or parallel.loss_parallel = false"),
    ([FSDP, "--parallel.tp=2", "--parallel.loss_parallel=true", "--train.loss=\"mine:loss\""],
     "needs the built-in loss (cross entropy on the split logits), but train.loss is 'mine:loss'"),
    ([FSDP, "--parallel.tp=2", "--parallel.sequence_parallel=true", "--model.factory=\"mine:model\""],
     "extends the built-in GPT's plan, and this run's model is its own"),
    ([FSDP, "--parallel.tp=2", "--parallel.sequence_parallel=true", "--data.block_size=15"],
     "sequence of 15 tokens (data.block_size, else model.block_size) over parallel.tp = 2"),
    ([FSDP, "--parallel.tp=2", "--parallel.loss_parallel=true", "--model.vocab_size=257"],
     "splits the built-in GPT's 257 tokens (model.vocab_size) over parallel.tp = 2"),
])
def test_a_degree_that_cannot_work_is_one_config_error(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*overrides, "--parallel.device=\"cpu\""])
    assert expected in str(err.value)


@pytest.mark.parametrize("overrides", [
    ["--parallel.tp=2", "--parallel.nproc=4", "--parallel.strategy=\"fsdp\""],
    ["--parallel.tp=2", "--parallel.nproc=4", "--parallel.strategy=\"fsdp\"", "--parallel.sharding=\"hybrid\"",
     "--parallel.shard_group_size=1"],
    ["--parallel.tp=2", "--parallel.nproc=2", "--parallel.strategy=\"ddp\""],
    ["--parallel.tp=2", "--parallel.nproc=4", "--parallel.strategy=\"fsdp\"", "--parallel.sequence_parallel=true",
     "--parallel.loss_parallel=true"],
    ["--parallel.tp=2", "--parallel.nproc=4", "--parallel.strategy=\"fsdp\"", "--elastic.fast_recovery=true"],
])
def test_tp_with_fsdp_any_sharding_or_ddp_at_tp_equal_world_loads(overrides):
    assert load_config(None, [*overrides, "--parallel.device=\"cpu\""]).parallel.tp == 2


def test_the_mesh_puts_a_tp_group_on_consecutive_ranks():
    layout = Layout.for_strategy("fsdp", "hybrid", 8, shard_group_size=2, tp=2)
    assert (layout.replicate, layout.shard, layout.tp, layout.dp_size) == (2, 2, 2, 4)
    assert [layout.replica_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [dp_coordinates(r, 8, 2) for r in (0, 1, 2, 7)] == [(0, 4), (0, 4), (1, 4), (3, 4)]
    with pytest.raises(ConfigError, match="does not cover a world of 8"):
        Layout(8, 2, 2, tp=3)


def test_the_gpt_plan_names_its_layers_and_a_user_plan_is_checked():
    model = GPT(TINY)
    plan = resolve_plan(model, None)
    assert sorted(plan) == sorted(f"blocks.{b}.{n}" for b in (0, 1)
                                  for n in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.0", "mlp.2"))
    check_plan(model, plan, 2, 4)  # 2 heads, 64 MLP columns: two whole halves
    with pytest.raises(UserError, match=r"blocks.0.attn.q \(2 heads\) evenly; use one of \[1, 2\]"):
        check_plan(model, plan, 4, 4)
    with pytest.raises(UserError, match="names no module of GPT"):
        resolve_plan(model, {"layers.*.q": "colwise"})
    with pytest.raises(UserError, match="use one of 'colwise', 'rowwise', 'sequence'"):
        resolve_plan(model, {"blocks.*.attn.q": "columns"})
    with pytest.raises(UserError, match="tied to tok_emb"):
        check_plan(model, resolve_plan(model, {"lm_head": ColwiseParallel()}), 2, 2)
    with pytest.raises(UserError, match="tied to lm_head"):
        check_plan(model, resolve_plan(model, {"tok_emb": "rowwise"}), 2, 2)
    check_plan(model, resolve_plan(model, {"tok_emb": "rowwise", "lm_head": "colwise"}), 2, 2)  # split alike
    with pytest.raises(UserError, match="tied to lm_head"):
        check_plan(model, resolve_plan(model, {"tok_emb": "colwise", "lm_head": "colwise"}), 2, 2)


def test_sequence_and_loss_parallel_extend_the_gpt_plan_only():
    model = GPT(TINY)
    plan = resolve_plan(model, None, sequence_parallel=True, loss_parallel=True)
    assert {"blocks.1.ln1", "blocks.1.ln2", "ln_f", "tok_emb", "lm_head"} <= set(plan)
    check_plan(model, plan, 2, 2)  # the tied embedding and LM head split by the same rows
    with pytest.raises(UserError, match="loss_parallel=True extends the built-in GPT's own plan, not a tp_plan"):
        resolve_plan(model, {"blocks.*.mlp.0": "colwise"}, loss_parallel=True)
    with pytest.raises(UserError, match="sequence_parallel=True .* not Linear, which has no tp_plan_for"):
        resolve_plan(nn.Linear(4, 4), None, sequence_parallel=True)


class _Base(nn.Module):
    """A Hugging Face base model's shape: `config.base_model_tp_plan`, `base_model` is itself."""

    def __init__(self, plan):
        super().__init__()
        self.config = SimpleNamespace(base_model_tp_plan=plan)
        self.layers = nn.ModuleList([nn.ModuleDict({"q": nn.Linear(8, 8), "o": nn.Linear(8, 8)})])

    @property
    def base_model(self):
        return self


def test_a_published_plan_is_named_from_the_root_and_its_own_styles_are_refused():
    wrapper = nn.Module()
    wrapper.hf = _Base({"layers.*.q": "colwise", "layers.*.o": "rowwise"})
    assert sorted(resolve_plan(wrapper, None)) == ["hf.layers.0.o", "hf.layers.0.q"]
    wrapper.hf = _Base({"layers.*.q": "colwise_rep"})
    with pytest.raises(UserError, match=r"uses the styles \['colwise_rep'\]"):
        resolve_plan(wrapper, None)


def test_a_toml_plan_is_read_and_each_bad_entry_is_one_error(tmp_path):
    toml = tmp_path / "tp.toml"
    toml.write_text('[parallel]\nstrategy = "fsdp"\nnproc = 4\ntp = 2\ndevice = "cpu"\n'
                    'tp_plan = {"blocks.*.attn.q" = "colwise", "blocks.*.attn.proj" = "rowwise"}\n')
    plan = load_config(toml).parallel.tp_plan
    assert plan == {"blocks.*.attn.q": "colwise", "blocks.*.attn.proj": "rowwise"}
    assert sorted(resolve_plan(GPT(TINY), plan)) == ["blocks.0.attn.proj", "blocks.0.attn.q",
                                                     "blocks.1.attn.proj", "blocks.1.attn.q"]
    for value, expected in (
        ('{"blocks.*.attn.q" = "columns"}', "tp_plan['blocks.*.attn.q'] is 'columns'; use one of 'colwise', "
                                            "'rowwise', 'sequence'"),
        ('{"blocks..q" = "colwise"}', "names 'blocks..q', which is not a module name"),
        ('{"blocks.*.attn.q" = 1}', "maps 'blocks.*.attn.q' to 1 (int); each value must be str"),
        ('"colwise"', "'parallel.tp_plan' must be a table"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(toml, [f"--parallel.tp_plan={value}"])
        assert expected in str(err.value) and "\n" not in str(err.value)


def test_a_plan_entry_that_names_no_module_names_the_nearest():
    with pytest.raises(UserError) as err:
        resolve_plan(GPT(TINY), {"blocks.*.attn.qq": "colwise"})
    assert "names no module of GPT; the nearest are blocks.0.attn.q, " in str(err.value)


@pytest.mark.parametrize("tp, said", [(2, "OK (4 files, step 1; world 4: tp 2 x dp 2, single)"),
                                      (3, "FAILED: manifest.json: ")])
def test_ckpt_verify_names_the_layout_and_refuses_a_degree_that_does_not_divide(tiny_checkpoint, tmp_path,
                                                                                 capsys, tp, said):
    _, step_dir = checkpoint_copy(tiny_checkpoint, tmp_path)
    path = step_dir / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "world_size": 4, "tp": tp}))
    assert ckpt_command.main(["verify", str(step_dir)]) == (0 if tp == 2 else 1)
    out = capsys.readouterr().out
    assert said in out and "\n" not in out.strip()
    assert tp == 2 or "tp 3 does not divide its world size 4" in out
