"""Hugging Face models without a download (model.hf / model.hf_path), and
`disttrain ckpt export --hf`: GPT-2 from a config trains under FSDP2 at 2 ranks through
examples/hf_gpt2.toml, and the exported folder gives the trained model's logits exactly;
a local Llama folder trains the same way at tp 2 x dp 2 and exports from its TP checkpoint.
"""

import json
import sys

import pytest
import torch
from conftest import ROOT, built_once, launch_worker, run_disttrain

transformers = pytest.importorskip("transformers")

from disttrain.checkpoint import export  # noqa: E402
from disttrain.checkpoint.hf_export import export_hf  # noqa: E402
from disttrain.cli import main as cli  # noqa: E402
from disttrain.errors import UserError  # noqa: E402
from disttrain.parallel.blocks import find_blocks  # noqa: E402
from disttrain.train.hf_models import HFCausalLM, build_hf_model  # noqa: E402

SMALL = {"hf": "gpt2", "hf_config": {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 256,
                                     "n_positions": 16, "bos_token_id": 0, "eos_token_id": 1}}
PROBE = torch.arange(2 * 12).view(2, 12) * 7 % 256


def _logits(model, x=PROBE):
    model.eval()
    with torch.no_grad():
        out = model(x)
    return out[0] if isinstance(out, tuple) else out.logits


def _step_dir(root):
    (step,) = sorted(root.glob("step-*"))[-1:]
    return step


@pytest.fixture(scope="module")
def toml_run(tmp_path_factory):
    """examples/hf_gpt2.toml at w=2 under fsdp, 4 steps on a slice of the corpus."""
    def run(out):
        proc = run_disttrain(["train", str(ROOT / "examples/hf_gpt2.toml"), "--train.steps=4",
                              f"--train.out_dir={out}", "--data.max_bytes=100000", "--train.batch_size=4",
                              "--train.eval_batches=1", "--train.log_every=1", "--model.block_size=32"],
                             timeout=120)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return out

    return built_once(tmp_path_factory, "hf-toml", run)


def test_gpt2_from_config_trains_under_fsdp_through_the_toml(toml_run):
    records = [json.loads(line) for line in (toml_run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 4 and all(l == l for l in losses)  # noqa: E741 (no NaN)
    assert losses[-1] < losses[0]
    summary = json.loads((toml_run / "summary.json").read_text())
    assert summary["strategy"] == "fsdp" and summary["world_size"] == 2


def test_hf_export_of_the_toml_run_has_identical_logits(toml_run, tmp_path, capsys):
    step = _step_dir(toml_run / "checkpoints")
    # `disttrain ckpt export` in this process: a subprocess would import torch and
    # transformers again for a command that starts no worker.
    assert cli(["ckpt", "export", str(toml_run / "checkpoints"), "--hf", str(tmp_path / "hf")]) == 0
    assert "from_pretrained" in capsys.readouterr().out
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    # The model rebuilt from the final checkpoint: its config, the prefix-free weights.
    model_section = json.loads((step / "state.json").read_text())["config"]["model"]
    rebuilt = build_hf_model(model_section)
    export.export_safetensors(step, tmp_path / "model.safetensors")
    from safetensors.torch import load_file

    rebuilt.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(exported, x), _logits(rebuilt, x))
    assert exported.lm_head.weight is exported.transformer.wte.weight  # the tie survived


def test_hf_export_equals_the_live_fsdp_model(tmp_path):
    # A checkpoint taken under FSDP2 at 2 ranks; the ranks also kept the live logits.
    launch_worker("hf_checks.py", 2, tmp_path, timeout=120)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["units"] == 2 for r in results)  # both GPT2Blocks sharded via the adapter
    assert results[0]["losses"][-1] < results[0]["losses"][0]
    info = export_hf(_step_dir(tmp_path / "ckpt"), tmp_path / "hf")
    assert info["model_type"] == "gpt2"
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(_logits(exported), torch.load(tmp_path / "logits.pt", weights_only=True))
    with pytest.raises(UserError, match="not an empty folder"):
        export_hf(_step_dir(tmp_path / "ckpt"), tmp_path / "hf")
    # hf_path loads the exported folder again (relative to the config's folder).
    again = build_hf_model({"hf_path": "hf"}, config_dir=tmp_path)
    assert torch.equal(_logits(again), _logits(exported))


def test_adapter_loss_blocks_and_keys():
    torch.manual_seed(0)
    model = build_hf_model(SMALL)
    assert isinstance(model, HFCausalLM)
    assert [type(b).__name__ for b in find_blocks(model)] == ["GPT2Block", "GPT2Block"]
    assert all(k.startswith("hf.") for k in model.state_dict())
    model.eval()  # GPT-2's default dropout off: the two forwards below must match
    x = torch.randint(0, 256, (2, 13))
    logits, loss = model(x[:, :-1], x[:, 1:])
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
    assert torch.equal(loss, ref)
    # Hugging Face's own shifted loss on the full window is the same next-token loss.
    assert torch.allclose(model(input_ids=x, labels=x).loss, model(x[:, :-1], x[:, 1:])[1], atol=1e-6)


def test_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(UserError, match=r"model.hf is 'gtp2'.*Did you mean 'gpt2'"):
        build_hf_model({"hf": "gtp2"})
    with pytest.raises(UserError, match="model.hf_path 'missing': no folder"):
        build_hf_model({"hf_path": "missing"}, config_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no config.json"):
        build_hf_model({"hf_path": "empty"}, config_dir=tmp_path)
    with pytest.raises(UserError, match="no causal language model class"):
        build_hf_model({"hf": "vit"})
    with pytest.raises(UserError, match="both set"):
        build_hf_model({"hf": "gpt2", "hf_path": "empty"}, config_dir=tmp_path)
    with pytest.raises(ValueError, match="model.block_size <= 16"):
        build_hf_model(SMALL)(torch.zeros(1, 17, dtype=torch.long))
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(UserError, match="pip install transformers"):
        build_hf_model(SMALL)


def test_model_pt_of_an_hf_run_loads_strict_into_the_hf_class(toml_run):
    """The final model.pt of `[model] hf` holds the Hugging Face model's own keys (it had
    the adapter's `hf.` prefix, and a strict load into the class failed)."""
    import tomllib

    section = tomllib.loads((ROOT / "examples/hf_gpt2.toml").read_text())["model"]
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("gpt2", **section["hf_config"]))
    state = torch.load(toml_run / "model.pt", map_location="cpu", weights_only=True)
    assert not any(k.startswith("hf.") for k in state)
    model.load_state_dict(state, strict=True)
    assert torch.equal(model.transformer.wte.weight, state["transformer.wte.weight"])


def test_export_hf_of_a_job_checkpoint_of_a_hugging_face_model(tmp_path, capsys):
    """A dt.Job script that trains a Hugging Face model it built itself: `disttrain ckpt
    export --hf` of its checkpoint gives the trained model's logits exactly (it used to
    refuse: "not a Hugging Face model")."""
    import disttrain as dt

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    x = torch.arange(4 * 9).view(4, 9) % 64
    with dt.Job(tmp_path, checkpoint_every=0, progress=False, tensorboard=False) as job:
        torch.manual_seed(0)
        model = job.wrap(transformers.LlamaForCausalLM(config))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = job.loader(torch.utils.data.TensorDataset(x), batch_size=2)
        job.resume(model=model, optimizer=opt)
        for (ids,) in job.steps(loader, max_steps=3):
            job.backward(model(input_ids=ids, labels=ids).loss)
    code = cli(["ckpt", "export", str(tmp_path / "checkpoints"), "--hf", str(tmp_path / "hf")])
    assert code == 0, capsys.readouterr()
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(exported).__name__ == "LlamaForCausalLM"
    trained = dt.unwrap(model)
    assert torch.equal(_logits(exported, x), _logits(trained, x))


LLAMA_TOML = """
[model]
hf_path = "ckpt/llama"
block_size = 16
[data]
max_bytes = 20000
[parallel]
strategy = "fsdp"
nproc = 4
tp = 2
[optim]
lr = 1e-2
[train]
steps = 3
batch_size = 2
eval_batches = 1
out_dir = "run"
[checkpoint]
dir = "ckpt"
[log]
tensorboard = false
"""


def test_a_llama_trained_at_tp2_dp2_through_the_cli_exports_with_the_same_logits(tmp_path, capsys):
    """A local Llama folder (model.hf_path) trained by `disttrain train` at tp 2 x dp 2
    under FSDP with its own published plan; `ckpt export --hf` of the TP checkpoint
    loads with from_pretrained and gives the logits of the run's own final weights.
    The folder lies inside the checkpoint folder, where the export may read it."""
    from disttrain.checkpoint.storage_formats import read_metadata

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "ckpt" / "llama")
    (tmp_path / "llama.toml").write_text(LLAMA_TOML)
    proc = run_disttrain(["train", str(tmp_path / "llama.toml")], timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["world_size"], summary["config"]["parallel"]["tp"], summary["steps"]) == (4, 2, 3)
    step = _step_dir(tmp_path / "ckpt")
    chunks = read_metadata(step).state_dict_metadata["model.hf.model.layers.0.self_attn.o_proj.weight"].chunks
    assert {c.offsets[1] for c in chunks} == {0, 16}  # o_proj (rowwise) was saved split by its inputs
    code = cli(["ckpt", "export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")])
    assert code == 0, capsys.readouterr()
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    trained = transformers.LlamaForCausalLM(config)
    trained.load_state_dict(torch.load(tmp_path / "run" / "model.pt", weights_only=True), strict=True)
    x = torch.arange(2 * 16).view(2, 16) * 7 % 256
    assert torch.equal(_logits(exported, x), _logits(trained, x))
