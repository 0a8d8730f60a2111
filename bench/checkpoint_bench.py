"""Checkpoint benchmark (not a test): save/load throughput against a raw sequential
write/read of the same bytes on the same disk, and the training stall of an async
save against a synchronous one, at world sizes 2 and 4.

    python bench/checkpoint_bench.py --dir CKPT_DIR [--worlds 2,4 --sizes 6x384,12x768]

Run with plain python (as `python -m bench --others` does) it launches one torchrun
job per world size and model size (`LAYERSxWIDTH` of the built-in GPT: 6x384 is 10.8M
parameters, where fixed costs show; 12x768 is 85M, where I/O dominates) and writes
them to bench/results/checkpoint.md (or --results). Each job replaces only its own
section of the file; the notes below stay. `--before-pkg NAME` adds rows for the
`Checkpointer` of an earlier tree importable as package NAME (its `disttrain.`
imports renamed), measured in the same repeats.

Within each repeat, on every rank at once: raw write + fsync of this rank's share of
the checkpoint's bytes, raw read of it, DCP alone (save with fsync, load; no
checksums, no manifest, no commit), then the disttrain sync save and its load, and the
async save (and the earlier tree's save and load), one after the other, so every ratio
compares figures of the same minute. Those last kinds take turns in each position
from one repeat to the next: give --repeat as a multiple of their number.

The disk decides more than the code here: this machine's virtual disk takes a burst
of writes fast and then falls to its sustained rate for seconds after (a save measured
0.5 s right after reads, 1.8 s a few seconds after another save), and with online
discard (ext4 `discard`) a write into blocks freed moments before ran 3x faster than
one into blocks already discarded. So each timed write starts after a `sync` and
--settle seconds of rest (5 by default; 2 still left the second save of each repeat
twice as slow as the first), and no timed save deletes: the checkpointers keep all,
and the bench deletes the old ones at the start of each repeat. Every write then
meets the disk at its sustained rate.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "checkpoint.md"


def evict(path: Path) -> None:
    """Drop a file (or every file under a folder) from the page cache; best effort."""
    for p in [path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main_world(args) -> None:
    import importlib

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import disttrain as dt
    from disttrain.builtin import GPT, GPTConfig
    from disttrain.checkpoint import Checkpointer, TrainState

    layers, width = map(int, args.size.split("x"))

    def barrier() -> None:
        dist.barrier()

    def settle() -> None:
        """Let the disk take the last writes first (see the module docstring)."""
        os.sync()
        time.sleep(args.settle)

    def timed(fn, write: bool = False) -> float:
        if write:
            settle()
        barrier()
        t0 = time.perf_counter()
        fn()
        barrier()
        return time.perf_counter() - t0

    def raw_write(path: Path, nbytes: int) -> None:
        chunk = os.urandom(1 << 22)
        with open(path, "wb") as f:
            left = nbytes
            while left > 0:
                left -= f.write(chunk[: min(left, len(chunk))])
            f.flush()
            os.fsync(f.fileno())

    def raw_read(*paths: Path) -> None:
        buf = bytearray(1 << 22)
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass

    def train_step(state: TrainState, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
        t0 = time.perf_counter()
        _, loss = state.model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        return time.perf_counter() - t0

    root = Path(args.dir)
    with dt.distributed(seed=0) as info:
        rank, world = info.rank, info.world_size
        cfg = GPTConfig(block_size=64, n_layer=layers, n_head=6, n_embd=width)
        model = dt.wrap(GPT(cfg), strategy="ddp")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        state = TrainState(model=model, optimizer=optimizer)
        batch = torch.randint(0, 256, (4, cfg.block_size + 1))
        train_step(state, optimizer, batch)  # optimizer state exists
        n_params = sum(p.numel() for p in model.parameters())
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
        barrier()
        sync_ck = Checkpointer(root / "off", keep_last=0)  # the bench deletes (below)
        async_ck = Checkpointer(root / "thread", keep_last=0, async_mode="thread")
        pg = dist.new_group(backend="gloo")
        cks = [sync_ck]
        if args.before_pkg:
            old = importlib.import_module(f"{args.before_pkg}.checkpoint").Checkpointer
            before_ck = old(root / "before", keep_last=0)
            before_ck.rank, before_ck.world = rank, world  # its runtime module never saw the init
            cks.append(before_ck)
        for ck in cks + [async_ck]:  # warm-up: first-use imports, plans, staging buffers not timed
            ck.save(state)
            ck.wait()
            ck.load(state)
        rows: dict[str, list[float]] = {}
        phases: list[dict[str, float]] = []  # this rank's `Checkpointer.last_load_phases` per sync load
        nbytes = 0

        def save_and_load(ck, prefix: str = "") -> None:
            """A sync save of `ck` and a cold load of it, as rows PREFIXsave, PREFIXload."""
            state.step += 1
            rows.setdefault(prefix + "save", []).append(timed(lambda: ck.save(state), True))
            if rank == 0:
                evict(ck.last_saved)
            rows.setdefault(prefix + "load", []).append(timed(lambda: ck.load(state)))
            if not prefix:
                phases.append(dict(ck.last_load_phases))

        def async_round() -> None:
            state.step += 1
            settle()
            barrier()
            t0 = time.perf_counter()
            async_ck.save(state)
            rows.setdefault("stall", []).append(time.perf_counter() - t0)  # the loop is blocked this long
            async_ck.wait()
            barrier()
            rows.setdefault("async_save", []).append(time.perf_counter() - t0)

        for i in range(args.repeat):
            if rank == 0:  # no timed save deletes an old checkpoint (see the docstring)
                for ck in cks + [async_ck]:
                    for old_dir in sorted(ck.root.glob("step-*"))[:-1]:
                        shutil.rmtree(old_dir)
            rows.setdefault("step", []).append(train_step(state, optimizer, batch))
            if not nbytes:
                assert sync_ck.last_saved is not None, "the synchronous save above ran"
                nbytes = sum(p.stat().st_size for p in sync_ck.last_saved.iterdir())
            raw = root / f"raw-{rank}.bin"
            rows.setdefault("raw_write", []).append(
                timed(lambda raw=raw, nbytes=nbytes: raw_write(raw, nbytes // world), True)
            )
            evict(raw)
            rows.setdefault("raw_read", []).append(timed(lambda raw=raw: raw_read(raw)))
            barrier()
            if rank == 0:
                evict(root)
            every = [root / f"raw-{r}.bin" for r in range(world)]
            rows.setdefault("raw_read_all", []).append(timed(lambda every=every: raw_read(*every)))
            barrier()
            raw.unlink()
            plain = root / f"dcp-{i}"
            tensors = state.state_dict()["tensors"]
            rows.setdefault("dcp_save", []).append(
                timed(
                    lambda tensors=tensors, plain=plain: dcp.save(
                        tensors, storage_writer=dcp.FileSystemWriter(str(plain), sync_files=True), process_group=pg
                    ),
                    True,
                )
            )
            if rank == 0:
                evict(plain)
            rows.setdefault("dcp_load", []).append(
                timed(
                    lambda tensors=tensors, plain=plain: dcp.load(
                        tensors, storage_reader=dcp.FileSystemReader(str(plain)), process_group=pg
                    )
                )
            )
            # the kinds take turns in each position, one repeat each (see the module docstring)
            kinds = [lambda: save_and_load(sync_ck), async_round]
            kinds += [lambda: save_and_load(before_ck, "before_")] if args.before_pkg else []
            for run in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:
                run()
            if rank == 0:
                shutil.rmtree(plain)
        for ck in cks + [async_ck]:
            ck.close()
        if rank == 0:
            write_section(args, world, rows, phases, nbytes, n_params, torch.__version__)


def phase_table(phases: list[dict[str, float]], loads: list[float]) -> list[str]:
    """Where rank 0's sync loads spent their time (`disttrain.checkpoint.load_phases`):
    the median of each phase, then the loads' mean and worst (a median hides a stall
    that comes one load in four)."""
    names = [n for n in phases[0] if n != "total"]
    ms = lambda values: f"{1000 * statistics.median(values):.0f}"  # noqa: E731
    return [
        "Where the disttrain load's time goes on rank 0 (milliseconds, median of the repeats; "
        "`Checkpointer.last_load_phases`):",
        "",
        "| " + " | ".join(names) + " | total | mean load | worst load |",
        "|" + "---:|" * (len(names) + 3),
        "| "
        + " | ".join(ms([p.get(n, 0.0) for p in phases]) for n in names)
        + f" | {ms([p['total'] for p in phases])} | {1000 * statistics.mean(loads):.0f} | {1000 * max(loads):.0f} |",
        "",
    ]


def write_section(
    args, world: int, rows: dict, phases: list[dict[str, float]], nbytes: int, n_params: int, torch_version: str
) -> None:
    gb = nbytes / 1e9
    load = os.getloadavg()[0]
    med = {k: statistics.median(v) for k, v in rows.items()}

    def paired(base: str, key: str) -> float:
        """Median over repeats of base/key, each pair measured in the same repeat."""
        return statistics.median(b / k for b, k in zip(rows[base], rows[key], strict=False))

    def row(label: str, key: str, base: str | None) -> str:
        ratio = f"{paired(base, key):.2f}x" if base else "1.00x"
        return f"| {label} | {med[key]:.3f} | {gb / med[key]:.2f} | {ratio} |"

    save_x, load_x = paired("raw_write", "save"), paired("raw_read", "load")
    verdict = lambda x: "met" if x >= 0.8 else "MISSED"  # noqa: E731
    key = f"world {world} size {args.size}"
    before = (
        [
            row("before (previous commit): save, sync", "before_save", "raw_write"),
            row("before (previous commit): load", "before_load", "raw_read"),
        ]
        if args.before_pkg
        else []
    )
    lines = [
        f"<!-- {key} -->",
        f"#### World size {world}, GPT {args.size} ({n_params / 1e6:.1f}M parameters)",
        "",
        f"GPT {n_params / 1e6:.1f}M parameters + AdamW state, DDP, {world} ranks on one machine; "
        f"checkpoint {nbytes / 1e6:.1f} MB; torch {torch_version}; median of {args.repeat}, each timed "
        f"write after a sync and {args.settle:g} s of rest; "
        f"load average {load:.1f} at the end ({os.cpu_count()} cores).",
        "",
        "| measurement (all ranks at once) | seconds | GB/s | x raw (paired per repeat) |",
        "|---|---:|---:|---:|",
        row("raw sequential write + fsync of the same bytes", "raw_write", None),
        row("DCP alone: save with fsync (no checksums, manifest, commit)", "dcp_save", "raw_write"),
        row("disttrain save, sync (shards hashed as written + manifest + commit)", "save", "raw_write"),
        row("disttrain save, async thread, until committed", "async_save", "raw_write"),
        row("raw sequential read of the same bytes (dropped from the page cache)", "raw_read", None),
        row("DCP alone: load (dropped from the page cache)", "dcp_load", "raw_read"),
        row("disttrain load (each file read once, checked, then deserialised)", "load", "raw_read"),
        *before,
        row(
            "raw read of the whole checkpoint's bytes on every rank (what a DDP load reads)", "raw_read_all", "raw_read"
        ),
        "",
        f"Target save >= 0.8x raw write: **{verdict(save_x)}** ({save_x:.2f}x); "
        f"load >= 0.8x raw read: **{verdict(load_x)}** ({load_x:.2f}x). Against DCP alone in the "
        f"same repeats: save {paired('dcp_save', 'save'):.2f}x, load {paired('dcp_load', 'load'):.2f}x. "
        f"Load against every rank reading the whole checkpoint: {paired('raw_read_all', 'load'):.2f}x.",
        "",
        *phase_table(phases, rows["load"]),
        f"Training stall per save: sync {med['save']:.3f} s ({med['save'] / med['step']:.1f} train "
        f"steps), async (thread) {med['stall']:.3f} s ({med['stall'] / med['step']:.1f} train steps: "
        f"the staging copy only).",
        f"<!-- end {key} -->",
    ]
    out = Path(args.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    old = out.read_text() if out.exists() else ""
    section = "\n".join(lines)
    pattern = re.compile(rf"<!-- {key} -->.*?<!-- end {key} -->", re.S)
    if pattern.search(old):
        text = pattern.sub(lambda _: section, old)
    elif "<!-- world " in old:
        text = old.rstrip() + "\n\n" + section + "\n"
    else:
        text = header(args) + section + "\n"
    out.write_text(text)
    print(section)


def header(args) -> str:
    return (
        "## Checkpoint save/load (disttrain.checkpoint, DCP, gloo, CPU)\n\n"
        f"Command: `python bench/checkpoint_bench.py --dir CKPT_DIR --worlds {args.worlds} "
        f"--sizes {args.sizes} --repeat {args.repeat} --settle {args.settle:g}`\n\n"
        "Each world and model size is one torchrun job; within each repeat the raw write/read and "
        "the checkpoint operations run one after the other on all ranks at once.\n\n"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--worlds", default="2,4", help="world sizes, one torchrun job each")
    ap.add_argument("--sizes", default="6x384,12x768", help="built-in GPT sizes, LAYERSxWIDTH, one job each")
    ap.add_argument("--size", default="6x384", help=argparse.SUPPRESS)  # the one size of a torchrun job
    ap.add_argument("--before-pkg", default="", help="package name of an earlier tree, for before rows")
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument(
        "--settle", type=float, default=5.0, help="seconds of rest for the disk before each timed write (after a sync)"
    )
    args = ap.parse_args()
    if "RANK" in os.environ:
        main_world(args)
        return 0
    out = Path(args.results)
    if not out.exists() or "<!-- world " not in out.read_text():
        out.write_text(header(args))  # else each section is replaced in place, notes kept
    for size in args.sizes.split(","):
        for world in map(int, args.worlds.split(",")):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={world}",
                __file__,
                *sys.argv[1:],
                "--size",
                size,
            ]
            if subprocess.run(cmd, timeout=1200).returncode:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
