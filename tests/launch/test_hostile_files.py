"""Special files and huge files in a folder someone else wrote are refused before they
are read (docs/security.md, "Exhaustion"): a FIFO, a symlink to /dev/zero, a sparse
file of gigabytes. Each command runs in a subprocess under a timeout (a FIFO's open
waits for a writer that never comes) and an address-space limit (a read of /dev/zero
or of a sparse file fills memory), and must end in one line naming the file.
"""

import os
import resource
import subprocess
import sys

import pytest
from conftest import ROOT, checkpoint_copy, worker_env

pytestmark = pytest.mark.timeout(240)

MEMORY = 3 << 30  # enough to import torch; a read of /dev/zero or 3 GiB is not


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def _disttrain(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disttrain.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=60, env=worker_env(), cwd=ROOT, preexec_fn=_limited)


def _one_line(proc, *said):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert all(s in lines[0] for s in said), lines[0]
    return lines[0]


def _manifest_made(saved, tmp_path, make):
    """A copy of the checkpoint whose manifest.json is what `make(path)` leaves there."""
    root, step_dir = checkpoint_copy(saved, tmp_path)
    manifest = step_dir / "manifest.json"
    manifest.unlink()
    make(manifest)
    return root


def _sparse(path, size):
    """A file of `size` bytes that takes no disk: `truncate` past its end."""
    with open(path, "wb") as f:
        f.truncate(size)


MANIFESTS = {
    "fifo": (os.mkfifo, "is a FIFO, not a regular file"),
    "dev-zero": (lambda p: p.symlink_to("/dev/zero"), "symlink"),
    "sparse-3GiB": (lambda p: _sparse(p, 3 << 30), "more than the 16777216"),
}


@pytest.mark.parametrize("kind", sorted(MANIFESTS))
@pytest.mark.parametrize("given", ["step", "root"])
def test_ckpt_verify_refuses_a_special_or_huge_manifest_in_one_line(tiny_checkpoint, tmp_path, kind, given):
    make, said = MANIFESTS[kind]
    root = _manifest_made(tiny_checkpoint, tmp_path, make)
    target = root / "step-00000001" if given == "step" else root  # a root lists its steps first
    _one_line(_disttrain("ckpt", "verify", target), "manifest.json", said, "refused")


def test_ckpt_inspect_refuses_a_fifo_manifest(tiny_checkpoint, tmp_path):
    root = _manifest_made(tiny_checkpoint, tmp_path, os.mkfifo)
    _one_line(_disttrain("ckpt", "inspect", root), "manifest.json", "is a FIFO")


def test_doctor_refuses_a_fifo_in_one_line(tmp_path):
    fifo = tmp_path / "train.py"
    os.mkfifo(fifo)
    _one_line(_disttrain("doctor", fifo), "train.py", "is a FIFO, not a regular file", "refused")


def test_report_refuses_a_huge_sparse_metrics_file(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _sparse(run / "metrics.jsonl", 2 << 30)
    _one_line(_disttrain("report", run), "metrics.jsonl", "more than the 536870912", "refused")


def test_report_refuses_a_fifo_metrics_file(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "metrics.jsonl")
    _one_line(_disttrain("report", run), "metrics.jsonl", "is a FIFO", "refused")
