"""`disttrain ckpt inspect|verify|export DIR`: look at, check and convert checkpoints.

DIR is a step directory or a checkpoint root (then its newest committed step).
Every command verifies the manifest before it reads anything else.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from disttrain.checkpoint import step_folders
from disttrain.checkpoint.checkpoint_errors import CheckpointCorrupt, CheckpointUnsafe
from disttrain.checkpoint.storage_formats import check_readable
from disttrain.errors import UserError
from disttrain.terminal_text import shown

USAGE = "disttrain ckpt {inspect,verify,export} DIR [--to model.safetensors] [--optim optim.pt] [--hf OUTDIR]"


def _step_dir(path: str) -> Path:
    """The step folder `path` names (see the module); a `UserError` for a path that does
    not exist or a root without a committed step."""
    p = Path(path)
    if not p.exists():
        raise UserError(
            f"{p} does not exist; pass a checkpoint root (a run's checkpoints/ folder, or "
            f"checkpoint.dir) or one of its step-* folders."
        )
    if p.name.startswith("step-") or (p / step_folders.MANIFEST).exists():
        return p
    found = step_folders.committed(p)
    if not found:
        raise UserError(f"{p} holds no committed checkpoint (no step-* directory).")
    return found[0][2]


def layout(manifest: dict) -> str:
    """How the ranks that wrote a checkpoint were laid out, in words: 'world 4: tp 2 x dp 2,
    fsdp' (tensor parallel x data parallel), 'world 2, ddp' without tensor parallelism."""
    world, tp, strategy = manifest.get("world_size"), manifest.get("tp", 1), manifest.get("strategy")
    if isinstance(world, int) and isinstance(tp, int) and tp > 1:
        return f"world {world}: tp {tp} x dp {world // tp}, {strategy}"
    return f"world {world}, {strategy}"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _text(value):
    """A folder's text as a rich cell: escaped (`terminal_text.shown`) and plain text,
    never read as rich's markup (whose `[link=...]` would write an escape sequence)."""
    from rich.text import Text

    return Text(shown(value))


def inspect(step_dir: Path) -> None:
    """Print the table of `step_dir`'s tensors and its manifest's facts. Every name
    and value from the folder is printed escaped (`terminal_text.shown`)."""
    from rich.console import Console
    from rich.table import Table

    from disttrain.checkpoint.export import tensor_table

    rows = tensor_table(step_dir)
    m = step_folders.read_manifest(step_dir)
    # The folder on a line of its own: a long path as the table's title wraps the facts
    table = Table(title=_text(f"step {m.get('step')}  {layout(m)}  generation {m.get('generation')}"))
    for col in ("tensor", "shape", "dtype", "size"):
        table.add_column(col, justify="right" if col == "size" else "left")
    for key, shape, dtype, nbytes in rows:
        cells = (key, "x".join(map(str, shape)) or "scalar", str(dtype).removeprefix("torch."), _human(nbytes))
        table.add_row(*map(_text, cells))
    console = Console(width=120)
    console.print(_text(str(step_dir)))
    console.print(table)
    files = sum(f["size"] for f in m["files"].values())
    console.print(
        _text(
            f"{len(rows)} tensors, {_human(sum(r[3] for r in rows))}; {len(m['files'])} files, "
            f"{_human(files)}; torch {m.get('torch_version')}, disttrain "
            f"{m.get('disttrain_version')}, config hash {m.get('config_hash')}"
        )
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="disttrain ckpt", usage=USAGE)
    parser.add_argument("action", choices=("inspect", "verify", "export"))
    parser.add_argument("dir")
    parser.add_argument("--to", help="export: the safetensors file to write")
    parser.add_argument("--optim", help="export: also write the full optimizer state here")
    parser.add_argument(
        "--hf",
        metavar="OUTDIR",
        help="export: a Hugging Face folder (safetensors + config.json) for a model.hf / model.hf_path run",
    )
    args = parser.parse_args(argv)
    step_dir = _step_dir(args.dir)
    if args.action == "verify":
        try:
            m = step_folders.verify(step_dir)
            check_readable(step_dir)  # what a load unpickles or parses first
        except CheckpointUnsafe:
            raise  # a UserError: one line, exit 2 (a folder made to mislead, not damage)
        except CheckpointCorrupt as e:
            print(shown(f"disttrain ckpt verify: FAILED: {e.bad_file or step_dir}: {e}", lines=True))
            return 1
        print(shown(f"{step_dir}: OK ({len(m['files'])} files, step {m.get('step')}; {layout(m)})"))
        return 0
    if args.action == "inspect":
        inspect(step_dir)
        return 0
    if args.hf:
        if args.to or args.optim:
            raise UserError("ckpt export takes either --hf OUTDIR or --to FILE [--optim FILE], not both.")
        from disttrain.checkpoint.hf_export import export_hf

        s = export_hf(step_dir, args.hf)
        print(
            shown(  # the model type is the checkpoint's text
                f"wrote {s['to']}: {s['model_type']}, {s['tensors']} tensors; load it with "
                f"AutoModelForCausalLM.from_pretrained({s['to']!r})"
            )
        )
        return 0
    if not args.to:
        raise UserError("ckpt export needs --to FILE.safetensors (or --hf OUTDIR for a Hugging Face model).")
    from disttrain.checkpoint.export import export_safetensors

    s = export_safetensors(step_dir, args.to, args.optim)
    print(
        f"wrote {s['to']}: {s['tensors']} tensors, {_human(s['bytes'])}"
        + (f"; optimizer state to {s['optimizer']}" if "optimizer" in s else "")
    )
    return 0
