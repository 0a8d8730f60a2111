"""Every trainer cell the README's table lists runs end to end through the real trainer:
steps, checkpoints, a kill -9 mid-run, the automatic resume (torchrun restart) and the
final export, with final weights bit-identical to an uninterrupted run (P-CKPT-1,
P-ELASTIC-3, P-FSDP-4). The cells come from `tests/workers/trainer_cells.py`'s `CELLS`, the list
README.md prints, so the table cannot claim a cell no test ran."""

from __future__ import annotations

import pytest
import torch
from conftest import ROOT, WORKERS, run_disttrain
from safetensors.torch import load_file
from workers.trainer_cells import CELLS, markdown_table

from disttrain.checkpoint import latest_valid
from disttrain.checkpoint.export import export_safetensors

WORKER = str(WORKERS / "matrix_cells.py")


def test_readme_table_is_the_tested_list():
    readme = (ROOT / "README.md").read_text()
    assert markdown_table() in readme, (
        "README's trainer-cell table is stale: paste `python tests/workers/trainer_cells.py`"
    )


def _launch(out, references, cells):
    """One launch: every cell of `references` uninterrupted (under OUT/reference), then
    every cell of `cells` killed once and resumed by torchrun (under OUT/killed)."""
    names = [c.name if c in cells else f"={c.name}" for c in references]  # `=`: a reference only
    args = ["run", "--nproc", str(cells[0].world), "--max-restarts", str(len(cells))]  # one restart per kill
    proc = run_disttrain([*args, WORKER, "both", str(out), *names], timeout=900)
    assert proc.returncode == 0, f"{names}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def _chunks() -> list[tuple[int, str]]:
    """(world, strategy) groups: separate tests, so a parallel run spreads them."""
    return sorted({(c.world, c.strategy if c.strategy in ("fsdp", "fsdp1") else "ddp+zero1+dp") for c in CELLS})


def _in_chunk(cell, world: int, group: str) -> bool:
    return cell.world == world and cell.strategy in group.split("+")


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("world, group", _chunks())
def test_every_cell_resumes_bit_exactly_after_kill_9(tmp_path, world, group):
    cells = [c for c in CELLS if _in_chunk(c, world, group)]
    # Parity across strategies is against DDP fp32 at the same world size (P-FSDP-4): its
    # uninterrupted run is part of every group's launch.
    base_cell = next((c for c in CELLS if c.world == world and c.strategy == "ddp" and c.precision == "fp32"
                      and not c.option), cells[0])
    _launch(tmp_path, cells if base_cell in cells else [base_cell, *cells], cells)
    for cell in cells:
        ref, got = tmp_path / "reference" / cell.name, tmp_path / "killed" / cell.name
        attempts = (got / "attempts").read_text().split()
        assert len(attempts) == 2, f"{cell.name}: attempts {attempts}"  # the kill fired once
        a = torch.load(ref / "model.pt", map_location="cpu", weights_only=True)
        b = torch.load(got / "model.pt", map_location="cpu", weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), cell.name
        final = latest_valid(got / "checkpoints")
        assert final is not None and final.name == "step-00000004", cell.name
        export_safetensors(final, tmp_path / f"{cell.name}.safetensors")
        exported = load_file(str(tmp_path / f"{cell.name}.safetensors"))
        assert all(torch.equal(exported[k].float(), b[k].float()) for k in b), cell.name
    # Parity across strategies: every fp32 cell's weights match DDP's (same dropout
    # streams, same samples; only the reduction order differs) (P-FSDP-4).
    base = torch.load(tmp_path / "reference" / base_cell.name / "model.pt", weights_only=True)
    for cell in cells:
        if cell.precision == "fp32":
            w = torch.load(tmp_path / "reference" / cell.name / "model.pt", weights_only=True)
            worst = max((w[k] - base[k]).abs().max().item() for k in base)
            assert worst < 1e-5, f"{cell.name} differs from {base_cell.name} by {worst:.2e}"


def test_the_groups_cover_every_cell_once():
    groups = _chunks()
    assert sorted(c.name for c in CELLS) == sorted(c.name for c in CELLS for w, g in groups if _in_chunk(c, w, g))
