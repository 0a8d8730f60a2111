"""The H200 run behind bench/gpu.sh: bf16 and fp8 GPT training, tokens/s, MFU, peak
memory, and the async-checkpoint stall, like for like at world 1.

    python -m bench.gpu_train --variant disttrain_fsdp --out DIR   # dt.wrap(strategy="fsdp")
    python -m bench.gpu_train --variant torch_autocast --out DIR   # the same, by hand
    python -m bench.gpu_train --variant disttrain_fp8_compiled --out DIR   # dt.wrap(precision="fp8")
    python -m bench.gpu_train --variant torchao_fp8_compiled --out DIR     # the same, by hand
    python -m bench.gpu_train --summarize DIR                      # DIR/gpu.md from the JSON

The model is `disttrain.builtin.GPT` with about 1.0B parameters (20 layers, width
2048, 16 heads, sequence 2048, byte vocabulary), micro-batch 8, AdamW, bf16
compute with fp32 master weights, world 1. Both sides are unsharded: at world 1
`dt.wrap(strategy="fsdp", precision="bf16")` runs the module as it is under bf16
autocast (sharding one device gains nothing), so the hand-written baseline is the
same: the plain module, its forward under `torch.autocast(dtype=torch.bfloat16)`,
AdamW on the fp32 parameters. (The earlier baseline was `fully_shard` on a 1-rank
mesh: sharded against unsharded, not like for like.)

FP8 (`bench/gpu.sh --fp8`): `dt.wrap(precision="fp8", compile=True)` against the same
step by hand: torchao's `convert_to_float8_training` (tensorwise scaling) on the linear
layers whose dimensions are multiples of 16 except the tied LM head, the forward under
bf16 autocast, each block compiled; both record how many layers they converted. The
bf16 compiled variant is the speed and loss baseline, and times the raw disk beside
disttrain's checkpoint in the same call (`--raw-disk`).

MFU = achieved FLOP/s / 989e12 (H200 dense bf16), with FLOP per token =
6 * N (non-embedding parameters) + 12 * layers * width * sequence (attention
scores and values, forward and backward, as in the PaLM paper; causal masking not
subtracted). The checkpoint stall is the time the training loop is blocked by an
async save (the call returning) against a synchronous save of the same state;
checkpoints go to a temporary folder that is deleted, never to the output folder.

`--dry-run` (or BENCH_GPU_DRY_RUN=1) runs the same code on the CPU with a tiny
model, gloo and 2 steps (fp8 through torchao's emulation, DISTTRAIN_FP8_EMULATE=1): it
proves the script, not the numbers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.checkpoint_bench import evict

PEAK_FLOPS = 989e12
# GPTConfig's keywords (disttrain is imported late: see _setup_env)
FULL: dict[str, Any] = {"block_size": 2048, "n_layer": 20, "n_head": 16, "n_embd": 2048, "dropout": 0.0, "bias": False}
TINY: dict[str, Any] = {"block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 64, "dropout": 0.0, "bias": False}
VARIANTS = (
    "torch_autocast",
    "disttrain_fsdp",
    "torch_autocast_compiled",
    "disttrain_fsdp_compiled",
    "disttrain_fp8_compiled",
    "torchao_fp8_compiled",
)
"""Eager, then compiled per block (`dt.wrap(compile=True)`, and by hand `block.compile()`
on each block, torchtitan's order): like for like in each pair; then fp8, compiled."""
HAND = ("torch_autocast", "torchao_fp8")
"""Prefixes of the hand-written variants."""
NO_CHECKPOINT = ("torch_autocast_compiled", "torchao_fp8_compiled")
"""Variants whose checkpoints would tell nothing new (the bound on the run's time)."""


def flops_per_token(cfg: dict, n_params: int) -> float:
    embed = cfg["n_embd"] * (256 + cfg["block_size"])  # tied byte embedding + positions
    return 6 * (n_params - embed) + 12 * cfg["n_layer"] * cfg["n_embd"] * cfg["block_size"]


def _setup_env() -> None:
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        from bench.common import free_port

        os.environ["MASTER_PORT"] = str(free_port())


def build(variant: str, cfg: dict, device: torch.device):
    """(model, optimizer, checkpoint function) for one variant."""
    from disttrain.builtin import GPT, GPTConfig

    torch.manual_seed(0)
    compiled = variant.endswith("_compiled")
    # On the CPU dry run the compiler's cheapest backend: it proves the path, not the speed.
    options: bool | dict = ({"backend": "aot_eager"} if device.type == "cpu" else True) if compiled else False
    if variant.startswith(HAND):
        import torch.distributed as dist

        # A process group as disttrain has one; nothing in the step uses it (world 1). DCP's
        # async save needs a CPU backend beside NCCL (it failed on the H200 without one).
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
        with device:
            model = GPT(GPTConfig(**cfg))
        if variant.startswith("torchao_fp8"):
            _float8_by_hand(model, emulate=device.type == "cpu")
        forward = model.forward

        def autocast_forward(*args, **kwargs):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return forward(*args, **kwargs)

        # (an instance attribute over the method: the unchanged module, run under autocast)
        model.forward = autocast_forward  # type: ignore[method-assign]
        if compiled:
            for block in model.blocks:
                block.compile(**(options if isinstance(options, dict) else {}))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        return model, optimizer, _dcp_checkpoint(model, optimizer)
    import disttrain as dt

    dt.init(device=device.type, seed=0)
    with device:
        model = GPT(GPTConfig(**cfg))
    precision = "fp8" if "_fp8" in variant else "bf16"
    wrapped = dt.wrap(model, strategy="fsdp", sharding="full", precision=precision, compile=options)
    dt_optimizer = dt.make_optimizer(wrapped, torch.optim.AdamW, lr=3e-4)
    return wrapped, dt_optimizer, _dt_checkpoint(wrapped, dt_optimizer)


def _float8_by_hand(model, emulate: bool) -> None:
    """torchao's Float8 training as its README shows it: tensorwise scaling on every
    nn.Linear whose dimensions are multiples of 16, here except the LM head (tied to the
    embedding), as disttrain chooses. `emulate` on the CPU dry run."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(emulate=emulate)

    def eligible(module, fqn: str) -> bool:
        return fqn != "lm_head" and module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, config=config, module_filter_fn=eligible)


def float8_layers(model) -> int:
    """How many of the model's layers compute in float8 (torchao's `Float8Linear`)."""
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def _dcp_checkpoint(model, optimizer):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    def save(root: Path, asynchronous: bool) -> tuple[float, float]:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        t0 = time.perf_counter()
        if not asynchronous:
            dcp.save(state, checkpoint_id=str(root))
            return time.perf_counter() - t0, time.perf_counter() - t0
        future = dcp.async_save(state, checkpoint_id=str(root))
        stall = time.perf_counter() - t0
        # (torch returns an AsyncSaveResponse only for an async_stager; its upload is the save)
        (future.upload_completion if isinstance(future, AsyncSaveResponse) else future).result()
        return stall, time.perf_counter() - t0

    def load(root: Path) -> float:
        msd, osd = get_state_dict(model, optimizer)
        t0 = time.perf_counter()
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(root))
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
        return time.perf_counter() - t0

    return save, load


def _dt_checkpoint(model, optimizer):
    from disttrain.checkpoint import Checkpointer, TrainState

    def save(root: Path, asynchronous: bool) -> tuple[float, float]:
        ckpt = Checkpointer(root, keep_last=1, async_mode="thread" if asynchronous else "off")
        state = TrainState(model=model, optimizer=optimizer, step=1)
        t0 = time.perf_counter()
        ckpt.save(state)
        stall = time.perf_counter() - t0
        ckpt.wait()
        total = time.perf_counter() - t0
        ckpt.close()
        return stall, total

    def load(root: Path) -> float:
        ckpt = Checkpointer(root, keep_last=1)
        t0 = time.perf_counter()
        if ckpt.load(TrainState(model=model, optimizer=optimizer, step=0)) is None:
            raise RuntimeError(f"no checkpoint found under {root}")
        ckpt.close()
        return time.perf_counter() - t0

    return save, load


def disk_rates(nbytes: int, tmp: Path) -> dict:
    """The raw disk on the same folder, for the checkpoint's GB/s to be read against: the
    state's byte count written from host memory with one fsync, dropped from the page
    cache, then read back (a cold read where the kernel honours the eviction)."""
    data = torch.empty(nbytes, dtype=torch.uint8).numpy()
    path = tmp / "raw.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data.data)  # (the array's buffer, no copy)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    evict(path)
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 26):
            pass
    read_s = time.perf_counter() - t0
    path.unlink()
    return {"raw_write_gbps": nbytes / write_s / 1e9, "raw_read_gbps": nbytes / read_s / 1e9}


def fingerprint(model) -> torch.Tensor:
    """One float per parameter: a load that restored the state gives the same vector."""
    return torch.stack([p.detach().float().sum() for p in model.parameters()]).cpu()


def checkpoint_rates(model, checkpoint, nbytes: int, tmp: Path, raw_disk: bool) -> dict:
    """Seconds and GB/s of a synchronous save, a cold load of it, and an async save (the
    stall the loop sees and the time until committed); the raw disk's rates when asked."""
    save, load = checkpoint
    out = disk_rates(nbytes, tmp) if raw_disk else {}
    before = fingerprint(model)
    out["ckpt_sync_s"] = save(tmp / "sync", False)[1]
    evict(tmp / "sync")
    with torch.no_grad():  # so that only a load that restores every tensor gives `before` back
        for param in model.parameters():
            param.add_(1.0)
    out["ckpt_load_s"] = load(tmp / "sync")
    out["ckpt_load_exact"] = bool(torch.equal(before, fingerprint(model)))
    shutil.rmtree(tmp / "sync")
    out["ckpt_async_stall_s"], out["ckpt_async_total_s"] = save(tmp / "async", True)
    out["ckpt_gbps"] = nbytes / out["ckpt_sync_s"] / 1e9
    out["ckpt_load_gbps"] = nbytes / out["ckpt_load_s"] / 1e9
    return out


def plan_estimate(cfg: dict, batch: int, precision: str = "bf16") -> dict:
    """`disttrain plan`'s per-device bytes for this model and step at world 1, in GiB: the
    unsharded row (what world 1 runs) and FSDP full (what a sharded run would hold)."""
    from disttrain.builtin import GPTConfig
    from disttrain.plan.memory import Variant, Workload, memory
    from disttrain.plan.model_size import from_gpt_config

    spec = from_gpt_config(GPTConfig(**cfg))
    work = Workload(precision=precision, optimizer="adamw", batch_per_device=batch, seq_len=cfg["block_size"])
    return {f"plan_{v}_gib": memory(spec, work, 1, Variant(v)).total / 2**30 for v in ("ddp", "fsdp_full")}


def run(variant: str, out: Path, dry: bool, steps: int, warmup: int, batch: int, raw_disk: bool = False) -> dict:
    _setup_env()
    device = torch.device("cpu" if dry else "cuda")
    if dry:  # no FP8 kernels on the CPU: torchao emulates them (proves the path, not the speed)
        os.environ["DISTTRAIN_FP8_EMULATE"] = "1"
    precision = "fp8" if "_fp8" in variant else "bf16"
    cfg = TINY if dry else FULL
    t_start = time.perf_counter()
    model, optimizer, checkpoint = build(variant, cfg, device)
    n_params = sum(p.numel() for p in model.parameters())
    # Like for like: both sides must run the same layout (here both unsharded).
    sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randint(0, 256, (batch, cfg["block_size"] + 1), generator=g).to(device)
    inputs, targets = x[:, :-1], x[:, 1:]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        _, loss = model(inputs, targets)  # bf16 autocast on both sides
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
        if step == 0:
            first_step_s = time.perf_counter() - t_start
    step_s = sorted(times)[len(times) // 2]
    tokens = batch * cfg["block_size"]
    result = {
        "variant": variant,
        "precision": precision,
        "fp8_layers": float8_layers(model),
        "dry_run": dry,
        "config": cfg,
        "params": n_params,
        "sharded": sharded,
        "batch": batch,
        "steps": steps,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "mfu": flops_per_token(cfg, n_params) * tokens / step_s / PEAK_FLOPS,
        "first_step_s": first_step_s,
        "loss": loss.item(),
    }
    if device.type == "cuda":
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        result["device"] = torch.cuda.get_device_name()
    else:
        result["peak_mem_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        result["device"] = "cpu (dry run)"
    result.update(plan_estimate(cfg, batch, precision))
    result.update(
        torch=torch.__version__,
        cuda=torch.version.cuda,
        date=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
    )
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{variant}.json"
    path.write_text(json.dumps(result, indent=1))  # the speed counts if a checkpoint hits the cap
    # Checkpoints where they tell something new, to bound the run: the raw disk and DCP by
    # hand once (eager), disttrain's checkpointer on each of its variants (a compiled or
    # fp8 model's state names are part of what is tested).
    if variant not in NO_CHECKPOINT:
        from disttrain.guard import tensor_nbytes

        result["state_bytes"] = tensor_nbytes(model, optimizer)
        tmp = Path(tempfile.mkdtemp(prefix="gpu-ckpt-"))
        try:
            result.update(checkpoint_rates(model, checkpoint, result["state_bytes"], tmp, raw_disk=raw_disk))
        except Exception as e:  # the training numbers still count
            result["ckpt_error"] = f"{type(e).__name__}: {e}"[:400]
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    path.write_text(json.dumps(result, indent=1))
    return result


MFU_GOAL = 0.40
PARITY = 0.03
"""The goals read against: compiled MFU at least 40%, disttrain within 3% of the hand-written step."""
FP8_SPEEDUP = 1.25
FP8_LOSS = 0.01
"""fp8 against bf16, both compiled: at least 1.25x the tokens/s, the loss within 1%."""


def summarize(out: Path, command: str) -> Path:
    """Write OUT/gpu.md from the variants' JSON files: speed and memory, checkpoints, and
    the verdicts against the goals."""
    results = [json.loads((out / f"{v}.json").read_text()) for v in VARIANTS if (out / f"{v}.json").exists()]
    kinds = "bf16 and fp8" if any(r.get("precision") == "fp8" for r in results) else "bf16"
    lines = [f"## GPU: {kinds} GPT at world 1, disttrain against the same step by hand (both unsharded)", ""]
    if not results:
        return _write(out, lines + ["No variant finished; see the logs in the output folder."])
    r0 = results[0]
    lines += [
        f"Command: `{command}`  ",
        f"Machine: {r0['device']}, torch {r0['torch']}, CUDA {r0['cuda']}; {r0['date']}.",
    ]
    if r0["dry_run"]:
        lines.append("**Dry run on the CPU with a tiny model: proves the script, not the numbers.**")
    lines += [
        "",
        f"Model: {r0['params'] / 1e6:,.1f}M parameters, {r0['config']}, micro-batch "
        f"{r0['batch']}; median of {r0['steps']} steps after warm-up. MFU against 989 TFLOP/s (dense bf16).",
        "",
        "| variant | precision | tokens/s | s / step | MFU | loss after the steps | peak memory GiB | "
        "plan GiB (unsharded) | s to first step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        precision = r.get("precision", "bf16")
        if precision == "fp8":
            precision += f" ({r['fp8_layers']} layers)"
        lines.append(
            f"| {r['variant']} | {precision} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | "
            f"{r['mfu']:.1%} | {r['loss']:.4f} | {r['peak_mem_gib']:.1f} | {r['plan_ddp_gib']:.1f} | "
            f"{r['first_step_s']:.1f} |"
        )
    if len({r.get("sharded") for r in results}) > 1:
        lines += ["", "**Not like for like: one side is sharded, the other not.**"]
    if len({r["fp8_layers"] for r in results if r.get("precision") == "fp8"}) > 1:
        lines += ["", "**Not like for like: the fp8 variants converted different layers.**"]
    lines += ["", *_checkpoint_table(results), "", *_verdicts(results)]
    return _write(out, lines)


def _checkpoint_table(results: list[dict]) -> list[str]:
    raw = next((r for r in results if "raw_write_gbps" in r), {})
    lines = [
        "| checkpoint | state GB | sync save s | save GB/s | cold load s | load GB/s | "
        "load exact | async stall s | async total s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "state_bytes" not in r:
            continue
        if "ckpt_error" in r:
            lines.append(f"| {r['variant']} | {r['state_bytes'] / 1e9:.2f} | {r['ckpt_error']} | | | | | | |")
            continue
        lines.append(
            f"| {r['variant']} | {r['state_bytes'] / 1e9:.2f} | {r['ckpt_sync_s']:.2f} | "
            f"{r['ckpt_gbps']:.2f} | {r['ckpt_load_s']:.2f} | {r['ckpt_load_gbps']:.2f} | "
            f"{r['ckpt_load_exact']} | {r['ckpt_async_stall_s']:.2f} | "
            f"{r['ckpt_async_total_s']:.2f} |"
        )
    if not raw:
        return lines
    lines.append(
        f"| raw disk (write + fsync, cold read) | | | {raw['raw_write_gbps']:.2f} | | "
        f"{raw['raw_read_gbps']:.2f} | | | |"
    )
    if "ckpt_gbps" in raw:  # the same process timed both: a like-for-like ratio
        lines += [
            "",
            f"- {raw['variant']} against the raw disk, same machine and call: save "
            f"{raw['ckpt_gbps'] / raw['raw_write_gbps']:.2f}x the raw write, load "
            f"{raw['ckpt_load_gbps'] / raw['raw_read_gbps']:.2f}x the raw cold read.",
        ]
    return lines


def _verdicts(results: list[dict]) -> list[str]:
    """One line per goal: compiled MFU against 40%, each pair's tokens/s against parity,
    fp8 against bf16 (speed-up and loss)."""
    by = {r["variant"]: r for r in results}
    lines = []
    for hand_name, ours_name, label in (
        ("torch_autocast", "disttrain_fsdp", "eager"),
        ("torch_autocast_compiled", "disttrain_fsdp_compiled", "compiled"),
        ("torchao_fp8_compiled", "disttrain_fp8_compiled", "fp8 compiled"),
    ):
        hand, ours = by.get(hand_name), by.get(ours_name)
        if hand and ours and hand["tokens_per_s"]:
            ratio = ours["tokens_per_s"] / hand["tokens_per_s"]
            met = "met" if ratio >= 1 - PARITY else "missed"
            lines.append(
                f"- disttrain / hand-written tokens/s ({label}): {ratio:.3f} (goal: within {PARITY:.0%}; {met})."
            )
    ours = by.get("disttrain_fsdp_compiled")
    if ours:
        met = "met" if ours["mfu"] >= MFU_GOAL else "missed"
        lines.append(f"- disttrain compiled MFU: {ours['mfu']:.1%} (goal: {MFU_GOAL:.0%}; {met}).")
    fp8 = by.get("disttrain_fp8_compiled")
    if ours and fp8 and ours["tokens_per_s"]:
        speedup = fp8["tokens_per_s"] / ours["tokens_per_s"]
        met = "met" if speedup >= FP8_SPEEDUP else "missed"
        lines.append(f"- fp8 / bf16 tokens/s (disttrain, compiled): {speedup:.3f} (goal: {FP8_SPEEDUP}x; {met}).")
        gap = abs(fp8["loss"] - ours["loss"]) / abs(ours["loss"])
        met = "met" if gap <= FP8_LOSS else "missed"
        lines.append(
            f"- fp8 loss after the steps {fp8['loss']:.4f} against bf16's {ours['loss']:.4f}: "
            f"{gap:.2%} apart (goal: within {FP8_LOSS:.0%}; {met})."
        )
    return lines


def _write(out: Path, lines: list[str]) -> Path:
    path = out / "gpu.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_train")
    ap.add_argument("--variant", choices=VARIANTS)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--summarize", type=Path, metavar="DIR")
    ap.add_argument("--command", default="bench/gpu.sh")
    ap.add_argument("--dry-run", action="store_true", default=os.environ.get("BENCH_GPU_DRY_RUN") == "1")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--raw-disk", action="store_true", help="also time the raw disk beside the checkpoint")
    args = ap.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize, args.command).read_text())
        return 0
    if not (args.variant and args.out):
        ap.error("give --variant and --out, or --summarize DIR")
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU check", file=sys.stderr)
        return 2
    steps = args.steps or (2 if args.dry_run else 15)
    warmup, batch = (1, 2) if args.dry_run else (3, 8)
    r = run(args.variant, args.out, args.dry_run, steps, warmup=warmup, batch=batch, raw_disk=args.raw_disk)
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
