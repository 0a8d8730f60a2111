"""Worker: tensor parallel x data parallel on 2 gloo ranks, in one launch
(tests/launch/test_tensor_parallel.py).

`python tp_checks.py OUT [grid | chain GRID_OUT]` under `disttrain run --nproc 2` (grid:
4); each rank writes OUT/rank{r}.json. `grid`: tp 2 x dp 2 under FSDP full, hybrid and
none, and full with sequence and loss parallel, against one process; then the first two
stages of the reshard chain.
`chain GRID_OUT`: its last two stages. The chain is one epoch of a `dt.Job` (fsdp) in
GRID_OUT/chain, a quarter at each layout, each stage resuming the one before: tp 2 x dp
2, tp 4 x dp 1, tp 1 x dp 2, tp 2 x dp 1 (with a plan given as the TOML's strings in
its `Config`, `MLP_PLAN`); each checks that the values it loaded (parameters and
momentum buffers) are bit-identical to those the stage before ended with, and records
its step, batches and split parameters; the tp 2 x dp 2 checkpoint is also loaded at
tp 1 x dp 4, tp 1 x dp 2 and tp 2 x dp 1 outside a Job, and `ckpt verify`'s line about
it is kept.
Without an argument:
- job: a `dt.Job(strategy="fsdp", tp=2)` run of the built-in GPT (tp 2 x dp 1) with
  clipping active, against a single-process copy trained on the same global batches:
  the batches each rank read, the max parameter difference, the held-out loss against
  the copy's, and the sample audit's files;
- plain: `dt.wrap(strategy="ddp", tp=2, tp_plan=torch ParallelStyles)`, a user's plan
  that splits only the MLPs, against one process the same way; whether its whole state
  (`model.pt`'s) holds plain tensors; and ranks that pass different plans;
- option: activation checkpointing, torch.compile (aot_eager), sequence parallel and
  loss parallel, each with fsdp at tp 2, against one process;
- hf: a small Hugging Face Llama under FSDP at tp 2 through its own published plan,
  against one process;
- reshard: the job's final checkpoint (tp 2 x dp 1) loaded at tp 1 x dp 2 (FSDP over
  both ranks): whether every parameter and momentum buffer is bit-identical;
- export: that checkpoint exported as one safetensors file (rank 0): whole tensors,
  equal to the trained ones.
"""

import contextlib
import copy
import io
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from strategy_checks import max_diff, trained_values
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel

import disttrain as dt
from disttrain.builtin import GPT, GPTConfig
from disttrain.checkpoint import ckpt_command
from disttrain.checkpoint.export import export_safetensors
from disttrain.checkpoint.files import full_model_state
from disttrain.config import Config, ParallelConfig
from disttrain.runtime.torch_compat import loss_parallel_active

CFG = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
STEPS, BATCH, LR, CLIP = 6, 4, 0.1, 0.5
CHAIN = GPTConfig(block_size=16, n_layer=1, n_head=4, n_embd=32)  # 4 heads: whole heads at tp 4
STAGE_STEPS = 4  # 4 stages of 4 steps at a global batch of BATCH: one epoch of 64 windows
MLP_PLAN = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}


class Windows(torch.utils.data.Dataset):
    def __init__(self, n: int = 64):
        self.x = torch.randint(0, 256, (n, CFG.block_size), generator=torch.Generator().manual_seed(7))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "index": i}


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def reference_step(ref, opt, x, clip=CLIP):
    opt.zero_grad()
    ref(x, x)[1].backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    opt.step()


def job_case(out: Path, results: dict):
    with dt.Job(out, strategy="fsdp", tp=2, grad_clip=CLIP, seed=0, record_samples=True, progress=False) as job:
        plain = GPT(CFG)
        ref = copy.deepcopy(plain)
        model = job.wrap(plain)
        opt = sgd(model)
        data = Windows()
        loader = job.loader(data, batch_size=BATCH)
        heldout = Windows(16)
        evaluator = job.evaluator(heldout, BATCH, metric=lambda m, b: {"loss": m(b["x"], b["x"])[1]})
        job.resume(model=model, optimizer=opt)
        seen = []
        for batch in job.steps(loader, max_steps=STEPS):
            seen.append(batch["index"].tolist())
            job.backward(model(batch["x"], batch["x"])[1])
        ref_opt = sgd(ref)
        for indices in seen:  # dp 1: this rank's batch is the global batch
            reference_step(ref, ref_opt, data.x[indices])
        results["job/seen"] = seen
        results["job/parity"] = max_diff(model, ref)
        with torch.no_grad():
            ref_eval = sum(ref(x, x)[1].item() for x in heldout.x.split(BATCH)) / (len(heldout) // BATCH)
        results["job/eval_diff"] = abs(evaluator.last["loss"] - ref_eval)
        results["job/audit"] = {f.name: [json.loads(line)["indices"] for line in f.read_text().splitlines()]
                                for f in sorted((out / "samples").glob("*.jsonl"))}
        # The other cases share the job's process group (one launch).
        plain_case(results)
        hf_case(results)
        options_case(results)
        values = trained_values(model)
        reshard_case(job.checkpoint_dir, values, momenta(model, opt), results)
        if job.info.rank == 0:  # `disttrain ckpt export`'s function: whole tensors
            export_safetensors(job.checkpoint_dir / f"step-{STEPS:08d}", out / "export.safetensors")
            exported = load_file(out / "export.safetensors")
            results["export/whole"] = all(torch.equal(exported[n], v) for n, v in values.items())
        (out.parent / f"rank{job.info.rank}.json").write_text(json.dumps(results))


def chain_stage(chain: Path, stage: int, tp: int, results: dict, plan: dict | None = None):
    """Stage `stage` (1 to 4) of the reshard chain in `chain` at tp x (world / tp): resume
    the stage before (its values in chain/stage{n-1}.pt), train STAGE_STEPS steps, save
    this stage's values (see the module)."""
    key, world = f"chain/{stage}", dt.rank_info().world_size
    config = Config(parallel=ParallelConfig(tp_plan=plan)) if plan else None
    with dt.Job(chain, config, strategy="fsdp", tp=tp, seed=0, progress=False) as job:
        torch.manual_seed(stage)  # other initial values at each stage: only the load makes them equal
        model = job.wrap(GPT(CHAIN))
        opt = sgd(model)
        loader = job.loader(Windows(), batch_size=BATCH * tp // world)
        job.resume(model=model, optimizer=opt)
        results[f"{key}/step"] = job.step
        if stage > 1:
            results[f"{key}/loaded_equal"] = same_values(model, opt, torch.load(chain / f"stage{stage - 1}.pt"))
        seen = []
        for batch in job.steps(loader, max_steps=stage * STAGE_STEPS):
            seen.append(batch["index"].tolist())
            job.backward(model(batch["x"], batch["x"])[1])
        results[f"{key}/seen"] = seen if job.info.rank % tp == 0 else []  # a TP group's batches once
        results[f"{key}/split"] = sorted(n for n, p in model.named_parameters() if tp_split(p))
        values = {"params": trained_values(model), "momenta": momenta(model, opt)}
        if job.info.rank == 0:
            torch.save(values, chain / f"stage{stage}.pt")
        dist.barrier()


def tp_split(p) -> bool:
    return "tp" in (getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ())


def same_values(model, opt, want: dict) -> bool:
    """Whether `model`'s full parameters and `opt`'s momentum buffers equal `want` bit for bit."""
    got = trained_values(model)
    pairs = zip(momenta(model, opt), want["momenta"], strict=True)
    return all(torch.equal(got[n], v) for n, v in want["params"].items()) and all(torch.equal(a, b) for a, b in pairs)


def grid_chain(out: Path, results: dict):
    """The chain's first two stages (4 ranks): tp 2 x dp 2, then tp 4 x dp 1; `ckpt
    verify`'s line about the first stage's checkpoint."""
    chain_stage(out / "chain", 1, 2, results)
    if dt.rank_info().rank == 0:
        with contextlib.redirect_stdout(io.StringIO()) as said:
            ckpt_command.main(["verify", str(out / "chain" / "checkpoints")])
        results["chain/verify"] = said.getvalue()
    results["chain/tp1_dp4_loads_stage1"] = loads_stage1(out / "chain", 1)
    chain_stage(out / "chain", 2, 4, results)


def loads_stage1(chain: Path, tp: int) -> bool:
    """Whether the tp 2 x dp 2 checkpoint of stage 1 loads at tp x (world / tp) outside a
    Job with the values stage 1 ended with (parameters and momentum buffers)."""
    torch.manual_seed(9)
    model = dt.wrap(GPT(CHAIN), strategy="fsdp", tp=tp)
    opt = sgd(model)
    dt.load(dt.TrainState(model=model, optimizer=opt), chain / "checkpoints" / f"step-{STAGE_STEPS:08d}")
    return same_values(model, opt, torch.load(chain / "stage1.pt"))


def chain_case(out: Path, grid_out: Path):
    """The chain's last two stages (2 ranks): tp 1 x dp 2, then tp 2 x dp 1 with
    `MLP_PLAN` from the config; first the tp 2 x dp 2 checkpoint loaded at both."""
    results: dict = {}
    chain = grid_out / "chain"
    with dt.distributed(seed=0) as info:
        for tp in (1, 2):
            results[f"chain/tp{tp}_loads_stage1"] = loads_stage1(chain, tp)
        chain_stage(chain, 3, 1, results)
        chain_stage(chain, 4, 2, results, plan=MLP_PLAN)
        (out / f"rank{info.rank}.json").write_text(json.dumps(results))


def momenta(model, opt) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        buf = opt.state[p]["momentum_buffer"]
        out.append((buf.full_tensor() if hasattr(buf, "full_tensor") else buf).detach().clone())
    return out


def plain_case(results: dict):
    torch.manual_seed(0)
    ref = GPT(CFG)
    plan = {"blocks.*.mlp.0": ColwiseParallel(), "blocks.*.mlp.2": RowwiseParallel()}
    model = dt.wrap(copy.deepcopy(ref), strategy="ddp", tp=2, tp_plan=plan)
    opt, ref_opt = sgd(model), sgd(ref)
    acc = dt.Accumulator(model, opt, 1, grad_clip=CLIP)
    g = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        x = torch.randint(0, 256, (BATCH, CFG.block_size), generator=g)
        reference_step(ref, ref_opt, x)
        with acc.micro_step():
            acc.backward(model(x, x)[1])
    results["plain/parity"] = max_diff(model, ref)
    whole, want = full_model_state(model), trained_values(model)  # model.pt's: whole tensors, not DTensor shards
    results["plain/whole"] = set(want) <= set(whole) and all(
        type(whole[n]) is torch.Tensor and torch.equal(whole[n], v) for n, v in want.items())
    mine = plan if dt.rank_info().rank == 0 else {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise",
                                                  "blocks.*.attn.q": "colwise"}
    try:
        dt.wrap(GPT(CFG), strategy="ddp", tp=2, tp_plan=mine)
    except dt.DistributedMismatchError as e:
        results["plan/mismatch"] = str(e)
    results["plain/split"] = sorted({n for n, p in model.named_parameters() if hasattr(p, "device_mesh")})


def options_case(results: dict):
    """Activation checkpointing, torch.compile per block, sequence parallel and loss
    parallel, each with fsdp at tp 2, against one process; what sequence and loss
    parallel change: the layers' input is a slice of the sequence, the logits a
    DTensor split over the vocabulary, and torch's loss_parallel() is left after each
    backward, also when the script enters it itself around its own backward."""
    cases = (("ac", {"activation_checkpointing": True}), ("compile", {"compile": {"backend": "aot_eager"}}),
             ("sp", {"sequence_parallel": True}), ("lp", {"loss_parallel": True}))
    for name, options in cases:
        torch.manual_seed(0)
        ref = GPT(CFG)
        model = dt.wrap(copy.deepcopy(ref), strategy="fsdp", tp=2, **options)
        opt, ref_opt = sgd(model), sgd(ref)
        acc = dt.Accumulator(model, opt, 1, grad_clip=CLIP)
        g = torch.Generator().manual_seed(5)
        seen: list = []
        first_block = dt.unwrap(model).blocks[0]  # the layers' input: the whole sequence or a slice
        first_block.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(list(args[0].shape)))
        for _ in range(3):
            x = torch.randint(0, 256, (BATCH, CFG.block_size), generator=g)
            reference_step(ref, ref_opt, x)
            with acc.micro_step():
                logits, loss = model(x, x)
                acc.backward(loss)
        results[f"option/{name}"] = max_diff(model, ref)
        results[f"option/{name}/block_input"] = seen[0]
        results[f"option/{name}/logits"] = [type(logits).__name__, list(logits.to_local().shape)
                                            if hasattr(logits, "to_local") else list(logits.shape)]
        results[f"option/{name}/left"] = not loss_parallel_active()
        plain = dt.unwrap(model)
        results[f"option/{name}/tied"] = plain.lm_head.weight is plain.tok_emb.weight
        if name == "sp":
            try:  # refused before any collective, on every rank alike
                model(x[:, :-1], x[:, :-1])
            except dt.UserError as e:
                results["option/sp/odd"] = str(e)
    with loss_parallel():  # a script's own context around forward and backward, as torch's docs show
        model(x, x)[1].backward()
    results["option/lp/own_context_left"] = not loss_parallel_active()


def hf_case(results: dict):
    """A small Llama through its own published plan, under FSDP at tp 2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CFG.block_size)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg)
    model = dt.wrap(copy.deepcopy(ref), strategy="fsdp", tp=2)
    opt, ref_opt = sgd(model), sgd(ref)
    acc = dt.Accumulator(model, opt, 1, grad_clip=CLIP)
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        x = torch.randint(0, 256, (BATCH, CFG.block_size), generator=g)
        ref_opt.zero_grad()
        ref(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        with acc.micro_step():
            acc.backward(model(input_ids=x, labels=x).loss)
    results["hf/parity"] = max_diff(model, ref)
    results["hf/split"] = sum(hasattr(p, "device_mesh") and p.device_mesh.ndim == 2 for p in model.parameters())


def reshard_case(ckpt_dir: Path, want: dict, want_momenta: list, results: dict):
    torch.manual_seed(1)  # other initial values: only the load can make them equal
    model = dt.wrap(GPT(CFG), strategy="fsdp", tp=1)
    opt = sgd(model)
    loaded = dt.load(dt.TrainState(model=model, optimizer=opt), ckpt_dir)
    got = trained_values(model)
    results["reshard/loaded"] = loaded is not None
    results["reshard/params_equal"] = all(torch.equal(got[n], want[n]) for n in want)
    pairs = zip(momenta(model, opt), want_momenta, strict=True)
    results["reshard/momenta_equal"] = all(torch.equal(a, b) for a, b in pairs)


def grid_case(out: Path):
    """tp 2 x dp 2 on 4 ranks: FSDP full for 20 steps, hybrid (2 replicas of 1 shard),
    none, and full with sequence and loss parallel for 5, with clipping, against one
    process on the global batches."""
    info, results = dt.rank_info(), {}
    both = {"sequence_parallel": True, "loss_parallel": True}
    for sharding, extra, steps in (("full", {}, 20), ("hybrid", {"shard_group_size": 1}, 5), ("none", {}, 5),
                                   ("full", both, 5)):
        torch.manual_seed(0)
        ref = GPT(CFG)
        model = dt.wrap(copy.deepcopy(ref), strategy="fsdp", sharding=sharding, tp=2, **extra)
        opt, ref_opt = sgd(model), sgd(ref)
        acc = dt.Accumulator(model, opt, 1, grad_clip=CLIP)
        g, d = torch.Generator().manual_seed(3), info.rank // 2  # the data-parallel rank
        for _ in range(steps):
            x = torch.randint(0, 256, (BATCH, CFG.block_size), generator=g)
            reference_step(ref, ref_opt, x)
            with acc.micro_step():
                acc.backward(model(x[d::2], x[d::2])[1])
        results[f"grid/{sharding}{'+sp+lp' if extra is both else ''}"] = max_diff(model, ref)
    grid_chain(out, results)
    (out / f"rank{info.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    if sys.argv[2:] == ["grid"]:
        with dt.distributed(seed=0):
            grid_case(Path(sys.argv[1]))
    elif sys.argv[2:3] == ["chain"]:
        chain_case(Path(sys.argv[1]), Path(sys.argv[3]))
    else:
        job_case(Path(sys.argv[1]) / "job", {})
