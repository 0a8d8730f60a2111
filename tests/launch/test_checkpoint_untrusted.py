"""Issue 42: a checkpoint folder runs no code and makes disttrain read nothing outside it
(docs/checkpoints.md "What a checkpoint folder can make disttrain do").

Each folder is built as an author would who was handed a real one: a file replaced,
the manifest's digests recomputed (they catch damage, not an author). The refusals
are checked through the real entry points: `disttrain ckpt inspect|verify|export`
and a `disttrain train` resume in subprocesses, `dt.load` (what every resume calls)
in one watched by an audit hook that reports any file opened outside the folder.
"""

import dataclasses
import io
import json
import os
import pickle
import runpy
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import ROOT, WORKERS, built_once, run_disttrain, worker_env
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from disttrain.checkpoint.digests import digest_bytes

pytestmark = pytest.mark.timeout(300)

FIXTURE = WORKERS.parent / "data" / "checkpoint_v1" / "run"  # the first format, committed
STEP = "step-00000002"


class Touch:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def _rewrite_manifest(step_dir, change):
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _replace(step_dir, name, data: bytes):
    """Write `data` as `name` and give the manifest its true size and digest."""
    (step_dir / name).write_bytes(data)

    def record(manifest):
        manifest.pop("storage", None)  # read as the first format
        manifest["files"][name] = digest_bytes(data)

    _rewrite_manifest(step_dir, record)


def _fixture_copy(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    return run, run / STEP


def _evil_metadata(step_dir, marker, where):
    """`.metadata` replaced by a pickle that runs `touch marker`: the whole file
    ("whole", as the issue's 60 bytes) or one field of the real metadata ("inside")."""
    if where == "whole":
        data = pickle.dumps(Touch(marker))
    else:
        with open(step_dir / ".metadata", "rb") as f:
            md = pickle.load(f)  # our own fixture's metadata, trusted here
        md.planner_data = {"model.x": Touch(marker)}
        data = pickle.dumps(md)
    _replace(step_dir, ".metadata", data)


def _evil_value(step_dir, marker):
    """One value record (an optimizer hyper-parameter, `BYTE_IO`) replaced by a
    `torch.save` of `Touch`, appended to its data file; `.metadata` points to it."""
    with open(step_dir / ".metadata", "rb") as f:
        md = pickle.load(f)
    fqn = "optim.param_groups.0.lr"
    assert isinstance(md.state_dict_metadata[fqn], BytesStorageMetadata)
    (index, info), = [(i, s) for i, s in md.storage_data.items() if i.fqn == fqn]
    shard = step_dir / info.relative_path
    buf = io.BytesIO()
    torch.save(Touch(marker), buf)
    data = shard.read_bytes()
    md.storage_data[index] = dataclasses.replace(info, offset=len(data), length=len(buf.getvalue()))
    _replace(step_dir, info.relative_path, data + buf.getvalue())
    _replace(step_dir, ".metadata", pickle.dumps(md))


def _one_error_line(proc, command):
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"disttrain {command}: error:")]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


# `disttrain ckpt inspect|verify|export` one after another in one process (one start of
# torch for three commands), each command's stderr ended by a line with its exit status
EVERY_CKPT = textwrap.dedent("""
    import sys
    from disttrain.cli import main
    run, to = sys.argv[1], sys.argv[2]
    for action in ("inspect", "verify", "export"):
        code = main(["ckpt", action, run, *(["--to", to] if action == "export" else [])])
        sys.stderr.write(f"=== {action} exited {code}\\n")
        sys.stderr.flush()
""")


def _every_ckpt_command(run, tmp_path) -> dict[str, subprocess.CompletedProcess]:
    """{action: what `disttrain ckpt ACTION RUN` returned and wrote to stderr}."""
    proc = subprocess.run([sys.executable, "-c", EVERY_CKPT, str(run), str(tmp_path / "out.safetensors")],
                          capture_output=True, text=True, timeout=120, env=worker_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results, lines = {}, []
    for line in proc.stderr.splitlines():
        if line.startswith("=== "):
            _, action, _, code = line.split()
            results[action] = subprocess.CompletedProcess(action, int(code), "", "\n".join(lines))
            lines = []
        else:
            lines.append(line)
    assert sorted(results) == ["export", "inspect", "verify"], proc.stderr[-3000:]
    return results


@pytest.mark.parametrize("where", ["whole", "inside"])
def test_a_metadata_pickle_naming_a_foreign_global_is_refused_by_every_ckpt_command(tmp_path, where):
    run, step_dir = _fixture_copy(tmp_path)
    marker = tmp_path / "ran"
    _evil_metadata(step_dir, marker, where)
    for action, proc in _every_ckpt_command(run, tmp_path).items():
        line = _one_error_line(proc, "ckpt")
        assert f"{step_dir / '.metadata'} asks its unpickler for posix.system" in line, (action, line)
    assert not marker.exists()  # after any of the three: nothing removes it
    assert not (tmp_path / "out.safetensors").exists()


def test_a_value_record_naming_a_foreign_global_is_refused_by_verify_and_by_a_load(tmp_path):
    run, step_dir = _fixture_copy(tmp_path)
    marker = tmp_path / "ran"
    _evil_value(step_dir, marker)
    proc, _, loaded = _verify_then_load(run, tmp_path / "nothing")
    line = _one_error_line(proc, "ckpt")
    assert "the value 'optim.param_groups.0.lr' asks for posix.system" in line, line
    assert "REFUSED CheckpointUnsafe" in loaded and "asks for posix.system" in loaded, loaded
    assert not marker.exists()


# `disttrain ckpt verify RUN`, then `dt.load` of the fixture's model, in one process (one
# start of torch for both), each file opened at OUTSIDE reported by an audit hook; stdout's
# "=== LOAD" line parts the two, and the exit status is verify's
VERIFY_THEN_LOAD = textwrap.dedent("""
    import os, sys
    run, outside = sys.argv[1], os.path.realpath(sys.argv[2])
    def watch(event, args):
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            if os.path.realpath(args[0]) == outside:
                sys.stdout.write("OPENED OUTSIDE\\n")
    sys.addaudithook(watch)
    from disttrain.cli import main
    code = main(["ckpt", "verify", run])
    sys.stdout.write("=== LOAD\\n")
    import disttrain as dt
    from ckpt_common import build
    from disttrain.builtin import GPTConfig
    from disttrain.checkpoint import CheckpointError
    state = build("ddp", GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=8, dropout=0.1), fused=True)
    try:
        dt.load(state, run)
        print("LOADED")
    except CheckpointError as e:
        print(f"REFUSED {type(e).__name__}: {e}")
    sys.exit(code)
""")


def _verify_then_load(run, outside) -> tuple[subprocess.CompletedProcess, str, str]:
    """(the process, verify's stdout, the load's stdout). A load that raised anything but
    a CheckpointError ends the process with status 1 and a traceback."""
    proc = subprocess.run([sys.executable, "-c", VERIFY_THEN_LOAD, str(run), str(outside)], capture_output=True,
                          text=True, timeout=120, env=worker_env(), cwd=ROOT)
    verified, _, loaded = proc.stdout.partition("=== LOAD\n")
    return proc, verified, loaded


def _outside_name(step_dir, outside, how):
    """Make the manifest (or the folder) point at `outside`, three ways."""
    digest = digest_bytes(outside.read_bytes())
    if how == "symlink":  # a listed file of the folder replaced by a symlink out
        (step_dir / "rank-00000.json").unlink()
        (step_dir / "rank-00000.json").symlink_to(outside)
        _rewrite_manifest(step_dir, lambda m: m["files"].__setitem__("rank-00000.json", digest))
        return "is a symlink to"
    name = os.path.relpath(outside, step_dir) if how == "dotdot" else str(outside)
    assert name.startswith("../") if how == "dotdot" else name.startswith("/")
    _rewrite_manifest(step_dir, lambda m: m["files"].__setitem__(name, digest))
    return f"names the file {name!r}, a path, not a plain name"


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_a_file_outside_the_folder_is_refused_and_never_read(tmp_path, how):
    run, step_dir = _fixture_copy(tmp_path)
    outside = tmp_path / "x.json"
    outside.write_text("{}")
    said = _outside_name(step_dir, outside, how)
    proc, verified, loaded = _verify_then_load(run, outside)
    line = _one_error_line(proc, "ckpt")
    assert said in line and "refused" in line, line
    assert "OPENED OUTSIDE" not in verified
    assert "REFUSED CheckpointUnsafe" in loaded and said in loaded, loaded
    assert "OPENED OUTSIDE" not in loaded


def test_metadata_pointing_to_a_data_file_outside_the_manifest_is_refused(tmp_path):
    run, step_dir = _fixture_copy(tmp_path)
    with open(step_dir / ".metadata", "rb") as f:
        md = pickle.load(f)
    outside = tmp_path / "x.distcp"
    outside.write_bytes((step_dir / "__0_0.distcp").read_bytes())
    index = next(iter(md.storage_data))
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], relative_path="../../x.distcp")
    _replace(step_dir, ".metadata", pickle.dumps(md))
    proc, _, loaded = _verify_then_load(run, outside)
    line = _one_error_line(proc, "ckpt")
    assert "points to the data file '../../x.distcp', which its manifest does not list" in line, line
    assert "REFUSED CheckpointUnsafe" in loaded and "OPENED OUTSIDE" not in loaded, loaded


def test_the_untouched_first_format_fixture_still_verifies_and_loads(tmp_path):
    run, step_dir = _fixture_copy(tmp_path)
    proc, verified, loaded = _verify_then_load(run, step_dir / "state.json")  # the watch does see what is read
    assert "LOADED" in loaded, proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0 and "OK (6 files, step 2; world " in verified, proc.stderr[-3000:]
    assert "OPENED OUTSIDE" in verified


def test_the_payload_does_run_when_unpickled(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Touch(marker)))
    assert marker.exists()


# ---------------------------------------------------------------- a `disttrain train` resume

SMALL = ["--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--model.block_size=32",
         "--data.max_bytes=50000", "--train.batch_size=4", "--train.eval_every=0",
         "--train.eval_batches=1", "--train.log_every=1", "--checkpoint.every=3",
         "--guard.enabled=false"]


def _train(out, steps, nproc=1):
    return run_disttrain(["train", "examples/tiny_gpt.toml", *SMALL, f"--parallel.nproc={nproc}",
                          f"--train.steps={steps}", f"--train.out_dir={out}"], timeout=240)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real run of 3 steps with its checkpoint at step 3."""
    def run(tmp):
        proc = _train(tmp / "base", 3)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return tmp / "base"

    return built_once(tmp_path_factory, "untrusted-trained", run)


@pytest.mark.parametrize("how, nproc", [("pickle", 1), ("dotdot", 1), ("pickle", 2)])
def test_a_disttrain_train_resume_refuses_the_folder_in_one_line(trained, tmp_path, how, nproc):
    """At 2 ranks both refuse (the verdict is agreed), and the launcher says it once."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    step_dir = out / "checkpoints" / "step-00000003"
    marker = tmp_path / "ran"
    if how == "pickle":
        _replace(step_dir, ".metadata", pickle.dumps(Touch(marker)))
        said = "asks its unpickler for posix.system"
    else:
        outside = tmp_path / "x.json"
        outside.write_text("{}")
        said = _outside_name(step_dir, outside, "dotdot")
    line = _one_error_line(_train(out, 6, nproc), "train")
    assert said in line and str(step_dir) in line, line
    assert not marker.exists()
    assert not (out / "checkpoints" / "step-00000006").exists()


JOB = textwrap.dedent("""
    import sys
    import torch
    from torch.utils.data import TensorDataset
    import disttrain as dt
    from disttrain.builtin import MLP, MLPConfig
    out, steps = sys.argv[1], int(sys.argv[2])
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
    with dt.Job(out, checkpoint_every=2) as job:
        model = job.wrap(MLP(MLPConfig()))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = job.loader(data, batch_size=8)
        job.resume(model=model, optimizer=optimizer)
        for x, y in job.steps(loader, max_steps=steps):
            job.backward(model(x, y)[1])
""")


def test_a_dt_job_resume_refuses_the_folder_in_one_line(tmp_path, monkeypatch):
    script, out, marker = tmp_path / "job.py", tmp_path / "out", tmp_path / "ran"
    script.write_text(JOB)
    # the folder to tamper with, from the script run in this process (a world of one,
    # as `--nproc 1` starts it; no launch to pay for); the resume below is launched
    monkeypatch.setattr(sys, "argv", [str(script), str(out), "2"])
    runpy.run_path(str(script), run_name="__main__")
    (step_dir,) = out.rglob("step-00000002")
    _replace(step_dir, ".metadata", pickle.dumps(Touch(marker)))
    proc = run_disttrain(["run", "--nproc", "1", str(script), str(out), "4"], timeout=150)
    out_err = proc.stdout + proc.stderr
    assert proc.returncode == 2, out_err[-3000:]
    assert out_err.count("asks its unpickler for posix.system") == 1 and "Traceback" not in out_err, out_err
    assert not marker.exists() and not list(out.rglob("step-00000004"))
