"""`disttrain plan ARGS`: parse the command line, call `estimate`, print or write the result.

Every input mistake becomes a `UserError` (argparse's own messages included), which
`disttrain.cli` prints as one line with exit status 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from disttrain.config.paths import PNG_SIGNATURE, has_prefix, output_file
from disttrain.errors import UserError
from disttrain.plan.memory import OPTIMIZERS, PRECISIONS

EXAMPLES = """examples:
  disttrain plan --params 1.3e9 --devices 8 --device-mem 80GiB --precision bf16 --batch 8 --seq-len 2048
  disttrain plan --gpt n_layer=12,n_embd=768,n_head=12,block_size=1024 --devices 4 --device-mem 24GiB
  disttrain plan --gpt examples/tiny_gpt.toml --devices 2 --device-mem 16GiB --format json
  disttrain plan --gpt n_layer=32,n_embd=4096,n_head=32,block_size=4096 --devices 8 \
      --device-mem 80GiB --precision bf16 --batch 8 --tp 2
  disttrain plan --hf path/to/config.json --devices 8 --nodes 2 --png plan.png \\
      --base-lr 3e-4 --base-batch 256 --steps 20000

tensor parallel: a second table plans each degree tp that divides the heads and the devices
of a node, FSDP full over the world / tp others; --batch is then each TP group's batch, and
the recommendation is the smallest degree that fits.

learning rate: effective batch = --batch x devices x nodes x --accum-steps (/ --tp); the LR scales
linearly up to 512, by the square root from 512 to 4096 (so also between 512 and 1024,
continuing from the linear value), and not at all beyond; warmup = min(5% of --steps, 2000).
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit; we want one line
        raise UserError(f"{message}. See `disttrain plan --help`.")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="disttrain plan",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Per-device memory (params, grads, optimizer state, activations, "
        "buffers) and communication per step of DDP, ZeRO-1 and FSDP, and of each "
        "tensor-parallel degree with FSDP, whether each fits, recommendations, and the "
        "scaled learning rate.",
    )
    src = p.add_argument_group("model (one of)")
    src.add_argument("--params", help="parameter count: 1.3e9, 350M, 7B (shape is assumed)")
    src.add_argument(
        "--gpt",
        help="disttrain GPT: 'n_layer=4,n_embd=128,...' or a disttrain "
        "TOML file whose [model] is a GPTConfig (its [train] and "
        "[optim] give defaults for the flags below)",
    )
    src.add_argument("--hf", help="a Hugging Face config.json (or its folder); nothing is downloaded")
    hw = p.add_argument_group("hardware")
    hw.add_argument("--devices", type=int, default=None, help="devices per node (default 1)")
    hw.add_argument("--nodes", type=int, default=1, help="nodes (default 1); world = devices x nodes")
    hw.add_argument("--device-mem", default="80GiB", help="memory per device (default 80GiB)")
    hw.add_argument(
        "--headroom", type=float, default=0.10, help="fraction kept free for what the model ignores (default 0.1)"
    )
    hw.add_argument(
        "--tp",
        type=int,
        default=None,
        help="the tensor-parallel degree you mean to run, checked and marked; every degree "
        "that divides the heads and a node's devices is planned either way (TOML: [parallel] tp)",
    )
    wl = p.add_argument_group("workload")
    wl.add_argument("--precision", choices=PRECISIONS, default=None, help="default fp32")
    wl.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default=None, help="default adamw")
    wl.add_argument("--batch", type=int, default=None, help="sequences per device per micro-step (default 1)")
    wl.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: model context)")
    wl.add_argument("--accum-steps", type=int, default=None, help="micro-steps per optimizer step (default 1)")
    lr = p.add_argument_group("learning rate (P-LOOP-4)")
    lr.add_argument("--base-lr", type=float, default=None, help="LR tuned at --base-batch")
    lr.add_argument("--base-batch", type=int, default=256, help="effective batch of --base-lr (default 256)")
    lr.add_argument("--steps", type=int, default=None, help="total optimizer steps, for warmup")
    out = p.add_argument_group("output")
    out.add_argument("--format", choices=("table", "json"), default="table")
    out.add_argument("--png", default=None, help="also write a stacked bar chart to this PNG file")
    return p


def _toml_defaults(raw: dict) -> dict:
    """Flag defaults taken from a disttrain TOML's [train], [optim] and [parallel] tables."""
    train, optim, par = (raw.get(k, {}) for k in ("train", "optim", "parallel"))
    d = {
        "batch": train.get("batch_size"),
        "accum_steps": train.get("accum_steps"),
        "precision": train.get("precision"),
        "steps": train.get("steps"),
        "devices": par.get("nproc"),
        "tp": par.get("tp"),
    }
    if optim.get("name") == "sgd":
        d["optimizer"] = "sgd-momentum" if optim.get("momentum", 0) else "sgd"
    elif optim.get("name"):
        d["optimizer"] = optim["name"]
    return {k: v for k, v in d.items() if v is not None}


def run(argv: list[str]) -> int:
    """Parse `argv`, plan, print. Returns the exit status."""
    from disttrain.plan import model_size
    from disttrain.plan import plan_report as report
    from disttrain.plan.planner import estimate

    args = build_parser().parse_args(argv)
    if args.png:  # before any work: never overwrite a file that is not an earlier chart
        output_file(args.png, "--png", replaceable=has_prefix(PNG_SIGNATURE))
    given = [k for k in ("params", "gpt", "hf") if getattr(args, k) is not None]
    if len(given) != 1:
        raise UserError(
            "give exactly one model: --params 1.3e9, --gpt n_layer=4,n_embd=128 "
            "(or a TOML file), or --hf config.json"
            + (f" (got {', '.join('--' + g for g in given)})" if given else "")
            + "."
        )
    defaults: dict = {}
    if args.params is not None:
        model = model_size.from_param_count(model_size.parse_count(args.params))
    elif args.hf is not None:
        model = model_size.from_hf_config(args.hf)
    elif args.gpt.endswith(".toml") or Path(args.gpt).is_file():
        cfg, raw = model_size.read_toml(args.gpt)
        model, defaults = model_size.from_gpt_config(cfg), _toml_defaults(raw)
    else:
        model = model_size.from_gpt_config(model_size.parse_gpt_spec(args.gpt))

    def pick(name: str, fallback):
        value = getattr(args, name)
        return value if value is not None else defaults.get(name, fallback)

    plan = estimate(
        model,
        devices=pick("devices", 1),
        nodes=args.nodes,
        device_mem=args.device_mem,
        precision=pick("precision", "fp32"),
        optimizer=pick("optimizer", "adamw"),
        batch_per_device=pick("batch", 1),
        seq_len=args.seq_len,
        accum_steps=pick("accum_steps", 1),
        headroom=args.headroom,
        base_lr=args.base_lr,
        base_batch=args.base_batch,
        steps=pick("steps", None),
        tp=pick("tp", None),
    )
    if args.format == "json":
        print(report.to_json(plan))
    else:
        report.print_table(plan)
    if args.png:
        path = report.write_png(plan, args.png)
        if args.format == "table":
            print(f"wrote {path}")
    return 0
