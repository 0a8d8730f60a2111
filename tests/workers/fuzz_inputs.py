"""Fuzz the readers of folders someone else wrote: `python fuzz_inputs.py SEED CASES WORK`.

Builds in WORK, once: a checkpoint of the current format (saved here), a copy of the
committed first-format fixture, a run folder (metrics, events, sample audit), a TOML
config, and a secret file beside them. Each case (seeded: case i of seed s is always
the same) changes one file in a structure-aware way (a value of another type, a deep
nest, a huge or negative number, NaN, an empty list, a path out of the folder, bytes
cut or not UTF-8), gives a checkpoint file its true digest in the manifest (so the
change reaches the parser, not only the checksum), runs one entry point the CLI runs
(`disttrain ckpt verify|inspect|export`, a resume through `Checkpointer.load`,
`disttrain report`'s reading, `disttrain train`'s config loading) in this process,
and restores the file.

A case passes when it ends in success or in a `UserError` (the one line the CLI
prints). Prints one JSON line: {"cases", "failures": [...], "slowest_s", "secret_seen"};
a failure is any other exception (with its traceback's last lines), and
"secret_seen" counts cases whose output or error held the secret's bytes or that
opened the secret's path (an audit hook watches every open).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import pickle
import random
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch
from ckpt_common import saved_once

from disttrain import cli
from disttrain.checkpoint import Checkpointer
from disttrain.checkpoint.digests import digest_bytes
from disttrain.config import load_config
from disttrain.errors import UserError
from disttrain.report.report_command import summary_rows
from disttrain.report.run_data import load_run

FIXTURE = Path(__file__).resolve().parent.parent / "data" / "checkpoint_v1" / "run"
TOML = Path(__file__).resolve().parents[2] / "examples" / "tiny_gpt.toml"
SECRET = b"fuzz-secret-7f3a9c1e"
NEST = "\x00nest\x00"  # stands for a deep nest in a document until it is written out


# ---------------------------------------------------------------- mutations


def weird(rng: random.Random):
    """A value of a type or size no reader expects."""
    return rng.choice(
        [
            None, True, -1, 0, 2**63, 10**30, -(10**30), 1.5, math.nan, math.inf, -math.inf, "", "x", "step",
            "../secret.txt", "/etc/passwd", [], {}, [1, 2], {"a": 1}, [[]], {"size": -5, "digest": 3},
            (NEST, rng.choice([70, 3000, 200_000])),
        ]
    )  # fmt: skip


def positions(doc) -> list[tuple]:
    """(container, key) of every value inside `doc`, walked without recursion."""
    out, todo = [], [doc]
    while todo:
        node = todo.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            out.append((node, key))
            todo.append(value)
    return out


def dumps(doc) -> bytes:
    """`doc` as JSON (NaN and infinities as JSON's extension tokens), deep nests spelled out."""
    nests: list[int] = []

    def mark(value):
        if isinstance(value, tuple) and value and value[0] == NEST:
            nests.append(value[1])
            return f"@@NEST{len(nests) - 1}@@"
        raise TypeError(type(value))

    text = json.dumps(doc, default=mark)
    for i, depth in enumerate(nests):
        text = text.replace(f'"@@NEST{i}@@"', "[" * depth + "]" * depth)
    return text.encode()


def mutate_json(data: bytes, rng: random.Random) -> bytes:
    """One structure-aware change of the JSON document `data` (or of its bytes)."""
    how = rng.random()
    if how < 0.15:
        return mutate_bytes(data, rng)
    doc = json.loads(data)
    spots = positions(doc)
    if how < 0.25 or not spots:
        return dumps(weird(rng))  # the whole document of another type
    node, key = rng.choice(spots)
    if how < 0.35 and isinstance(node, dict):
        del node[key]
    else:
        node[key] = weird(rng)
    return dumps(doc)


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    how = rng.randrange(4)
    at = rng.randrange(len(data) + 1)
    if how == 0:
        return data[:at]  # cut short
    if how == 1:
        return data[:at] + b"\xff\xfe\xc3" + data[at:]  # not UTF-8
    if how == 2 and data:
        return data[:at] + bytes([data[at % len(data)] ^ 1 << rng.randrange(8)]) + data[at + 1 :]
    return data + b"[" * 100_000


def mutate_pickle(data: bytes, rng: random.Random) -> bytes:
    """One change of DCP's pickled metadata: a field of one of its objects, or its bytes."""
    if rng.random() < 0.3:
        return mutate_bytes(data, rng)
    md = pickle.loads(data)  # our own fixture's, trusted here
    infos = list(md.storage_data.values())
    tensors = [m for m in md.state_dict_metadata.values() if hasattr(m, "chunks")]
    choice = rng.randrange(6)
    if choice == 0:
        setattr(rng.choice(infos), rng.choice(["offset", "length"]), rng.choice([-1, 2**40, 10**30, 1 << 62]))
    elif choice == 1:
        meta = rng.choice(tensors)
        meta.size = torch.Size([rng.choice([1 << 20, 1 << 40, 0])] * max(1, len(meta.size)))
    elif choice == 2:
        key = rng.choice(list(md.planner_data))
        md.planner_data[key] = rng.choice([(), ("model", 10**9), ("model", -1), ("model",) * 100])
    elif choice == 3:
        chunk = rng.choice(rng.choice(tensors).chunks)
        chunk.sizes = torch.Size([rng.choice([1 << 30, 0])] * len(chunk.sizes))
    elif choice == 4:
        setattr(md, rng.choice(["state_dict_metadata", "storage_data", "planner_data"]), rng.choice([[], 5, "x"]))
    else:
        return rng.choice(
            [
                b"cpathlib\nPosixPath\nN}Vx\nI1\ns\x86b.",
                b"ctorch.distributed.checkpoint.metadata\nMetadataIndex\nN}V__eq__\nctorch\nSize\ns\x86b.",
                b"(" * 100_000 + b".",
                b"]" + b"(]a" * 50_000 + b".",
            ]
        )
    return pickle.dumps(md)


def mutate_toml(text: str, rng: random.Random) -> bytes:
    """One change of a TOML config: a deep nest, a cut, a value of another type, bytes
    that are not UTF-8, a table of a long dotted name."""
    lines = text.splitlines()
    how = rng.randrange(5)
    if how == 0:
        depth = rng.choice([70, 5000])
        return (text + "\n[extra]\nx = " + "[" * depth + "]" * depth).encode()
    if how == 1:
        return text[: rng.randrange(len(text) + 1)].encode()
    if how == 3:
        return text.encode() + b"\n# \xff\xfe\n"
    values = ["1e400", "nan", "-1", '"x"', "[]", "{}", "[[1]]", '"../secret.txt"', "9" * 5000, "inf", "true"]
    settings = [i for i, line in enumerate(lines) if "=" in line and not line.lstrip().startswith("#")]
    if how == 2 and settings:
        i = rng.choice(settings)
        lines[i] = lines[i].split("=", 1)[0] + "= " + rng.choice(values)
        return "\n".join(lines).encode()
    return (text + "\n[" + "a." * rng.choice([70, 3000]) + "b]\n").encode()


def override(rng: random.Random) -> str:
    key = rng.choice(["train.steps", "optim.lr", "model.hf_config.x", "a." * 200 + "b", "train"])
    value = rng.choice(["[" * 5000 + "]" * 5000, "1e400", "nan", "{a = 1}", "[[[]]]", "\xff", "=", ""])
    return f"--{key}={value}"


# ---------------------------------------------------------------- the folders and entry points


class Folders:
    """What the cases change, each file's pristine bytes, and the state a resume loads into."""

    def __init__(self, work: Path):
        self.root = work / "ckpt"
        self.state = saved_once(self.root)
        self.step = self.root / "step-00000001"
        self.v1 = work / "v1"
        shutil.copytree(FIXTURE, self.v1)
        self.v1_step = self.v1 / "step-00000002"
        self.run = work / "run"
        (self.run / "samples").mkdir(parents=True)
        metrics = [{"step": s, "loss": 3.0 - s / 10, "world_size": 2, "attempt": s // 4,
                    "tokens_per_s": 1000.0, "step_time_s": [0.1, 0.2], "peak_mem_mb": [10.0, 11.0],
                    "step_time_max_s": 0.2, "step_time_min_s": 0.1} for s in range(1, 9)]  # fmt: skip
        (self.run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
        events = [{"attempt": a, "step": 4 * a, "world_size": 2 - a} for a in range(2)]
        (self.run / "run_events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        audit = [
            {"generation": g, "step": s, "world": 2, "rank": 0} for g in range(2) for s in range(4 * g + 1, 4 * g + 4)
        ]
        (self.run / "samples" / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in audit))
        self.toml = work / "config.toml"
        self.toml_text = TOML.read_text()
        self.out = work / "out"
        self.out.mkdir()
        files = [
            p for d in (self.step, self.v1_step, self.run, self.run / "samples") for p in d.iterdir() if p.is_file()
        ]
        files += [self.root / "WRITER.json", self.v1 / "WRITER.json"]
        self.pristine = {p: p.read_bytes() for p in files}
        self.stamps = {p: p.stat().st_mtime_ns for p in files}

    def restore(self) -> None:
        """Put back each file a case may have changed: those newer than the last restore."""
        for path, data in self.pristine.items():
            try:
                changed = path.is_symlink() or path.stat().st_mtime_ns != self.stamps[path]
            except (FileNotFoundError, KeyError):
                changed = True
            if changed:
                path.unlink(missing_ok=True)
                path.write_bytes(data)
                self.stamps[path] = path.stat().st_mtime_ns


def write_checkpoint_file(step_dir: Path, name: str, data: bytes) -> None:
    """Write `data` as `name` of `step_dir` and give the manifest its true record."""
    (step_dir / name).write_bytes(data)
    if name in ("manifest.json", "WRITER.json"):
        return
    manifest_path = step_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_bytes())
    manifest["files"][name] = digest_bytes(data)
    manifest_path.write_bytes(json.dumps(manifest).encode())


def checkpoint_case(f: Folders, rng: random.Random) -> tuple[str, callable]:
    """Change one file of one checkpoint; returns (what, the entry point to run)."""
    first = rng.random() < 0.15  # the first format's pure-Python unpickler is the slower reader
    step = f.v1_step if first else f.step
    names = sorted(p.name for p in step.iterdir() if p.is_file() and not p.name.endswith(".distcp"))
    name = rng.choice(names + ["WRITER.json", "symlink"])
    if name == "WRITER.json":
        path = step.parent / name
        path.write_bytes(mutate_json(path.read_bytes(), rng))
    elif name == "symlink":  # a file of the folder replaced by a link to the secret
        name = rng.choice(names)
        (step / name).unlink()
        (step / name).symlink_to(step.parent.parent / "secret.txt")
    else:
        data = (step / name).read_bytes()
        mutated = mutate_pickle(data, rng) if first and name == ".metadata" else mutate_json(data, rng)
        write_checkpoint_file(step, name, mutated)
    # mostly the cheap check every other entry point begins with; now and then the rest
    action = rng.choices(["verify", "load", "inspect", "export"], weights=[92, 3, 3, 2])[0]
    if action == "load" and not first:
        return f"raw {name} {action}", lambda: Checkpointer(f.root).load(f.state)
    if action == "load" or (first and action == "export"):
        action = "verify"
    args = ["ckpt", action, str(step)] + (["--to", str(f.out / "m.safetensors")] if action == "export" else [])
    return (
        f"{'v1' if first else 'raw'} {name} {action}",
        lambda: (f.out / "m.safetensors").unlink(missing_ok=True) or cli.main(args),
    )


def run_case(f: Folders, rng: random.Random) -> tuple[str, callable]:
    name = rng.choice(["metrics.jsonl", "run_events.jsonl", "samples/rank0.jsonl"])
    path = f.run / name
    lines = path.read_bytes().splitlines()
    i = rng.randrange(len(lines))
    lines[i] = mutate_json(lines[i], rng)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return f"run {name}", lambda: summary_rows(load_run(f.run))


def config_case(f: Folders, rng: random.Random) -> tuple[str, callable]:
    if rng.random() < 0.3:
        item = override(rng)
        return f"override {item[:40]!r}", lambda: load_config(TOML, [item])
    f.toml.write_bytes(mutate_toml(f.toml_text, rng))
    return "toml", lambda: load_config(f.toml)


# ---------------------------------------------------------------- the loop


def one_case(f: Folders, i: int, seed: int) -> tuple[str, str | None, str]:
    """Run case `i`: (what it changed, the failure or None, what it printed or raised)."""
    rng = random.Random(seed * 1_000_003 + i)
    make = rng.choices([checkpoint_case, run_case, config_case], weights=[4, 3, 3])[0]
    what, call = make(f, rng)
    out = io.StringIO()
    failure = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            call()
    except UserError as e:
        out.write(str(e))
    except Exception as e:  # noqa: BLE001 (each is a failure of the case, reported)
        failure = f"{type(e).__name__}: {str(e)[:200]} | " + " <- ".join(
            f"{Path(fr.filename).name}:{fr.lineno}" for fr in traceback.extract_tb(e.__traceback__)[-4:]
        )
    finally:
        f.restore()
    return what, failure, out.getvalue()


def main(seed: int, cases: int, work: Path) -> None:
    secret = work / "secret.txt"
    secret.write_bytes(SECRET)
    opened: list[str] = []
    sys.addaudithook(
        lambda event, args: event == "open" and str(args[0]).endswith("secret.txt") and opened.append(str(args[0]))
    )
    f = Folders(work)
    failures, seen, slowest = [], 0, 0.0
    for i in range(cases):
        start, before = time.monotonic(), len(opened)
        what, failure, said = one_case(f, i, seed)
        slowest = max(slowest, time.monotonic() - start)
        if failure is not None:
            failures.append(f"case {i} ({what}): {failure}")
        if SECRET.decode() in said or len(opened) > before:
            seen += 1
            failures.append(f"case {i} ({what}): the secret was read")
    print(json.dumps({"cases": cases, "failures": failures, "slowest_s": slowest, "secret_seen": seen}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
