"""Malformed and hostile inputs from a folder someone else wrote (docs/security.md): each
ends in success or in one line naming the file, exit 2; the restricted unpickler
changes no class; what a folder declares is checked against what it holds; a fuzz
run over checkpoints, run folders and configs finds no traceback, no hang, no memory
past 1 GiB and no read outside the folder.
"""

import json
import pathlib
import resource
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, WORKERS, checkpoint_copy, worker_env
from torch.distributed.checkpoint.metadata import MetadataIndex

from disttrain.checkpoint.digests import digest_bytes

pytestmark = pytest.mark.timeout(240)

FIXTURE = WORKERS.parent / "data" / "checkpoint_v1" / "run"
STEP = "step-00000002"
FUZZ_CASES, FUZZ_SEED = 2_500, 20_260_601
MEMORY = 1 << 30


def _copy(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    return run / STEP


def _replace(step_dir, name, data: bytes):
    """Write `data` as `name` and give the manifest its true record, so the change
    reaches the parser (a digest catches damage, not an author)."""
    (step_dir / name).write_bytes(data)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][name] = digest_bytes(data)
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def _cli(capsys, *args) -> subprocess.CompletedProcess:
    """`disttrain ARGS` run in this process (the real CLI, its one-line errors included):
    its exit status and what it printed."""
    from disttrain import cli

    capsys.readouterr()
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def _one_line(proc, *said):
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and all(s in lines[0] for s in said), lines
    return lines[0]


def _verify_failed(proc, *said):
    """`ckpt verify`'s report of a damaged checkpoint: one FAILED line, exit 1 (a folder
    built to mislead, `CheckpointUnsafe`, is one error line, exit 2)."""
    if proc.returncode == 2:
        return _one_line(proc, *said)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, (proc.stdout, proc.stderr[-3000:])
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and "FAILED" in lines[0] and all(s in lines[0] for s in said), lines
    return lines[0]


# ---------------------------------------------------------------- the unpickler


SET_ON_CLASS = {
    "PosixPath.x": b"cpathlib\nPosixPath\nN}Vx\nI1\ns\x86b.",
    "MetadataIndex.__eq__": (
        b"ctorch.distributed.checkpoint.metadata\nMetadataIndex\nN}V__eq__\nctorch\nSize\ns\x86b."
    ),
}


@pytest.mark.parametrize("what", sorted(SET_ON_CLASS))
def test_a_metadata_pickle_that_sets_attributes_on_a_class_is_refused_and_the_class_unchanged(tmp_path, capsys, what):
    from disttrain.checkpoint import dcp_read
    from disttrain.checkpoint.checkpoint_errors import CheckpointUnsafe

    step = _copy(tmp_path)
    _replace(step, ".metadata", SET_ON_CLASS[what])
    eq, before = MetadataIndex.__eq__, dict(vars(pathlib.PosixPath))
    try:
        with pytest.raises(CheckpointUnsafe, match="sets state on"):
            dcp_read.read_metadata(step)
        _one_line(_cli(capsys, "ckpt", "verify", step), str(step / ".metadata"), "refused")
        assert MetadataIndex.__eq__ is eq and dict(vars(pathlib.PosixPath)) == before
    finally:  # what an unpickler that let it through changed: put back for the other tests
        MetadataIndex.__eq__ = eq
        for name in set(vars(pathlib.PosixPath)) - set(before):
            delattr(pathlib.PosixPath, name)


def test_the_unpickler_sets_only_declared_fields_of_allowed_instances(tmp_path):
    import io
    import pickle

    from disttrain.checkpoint.checkpoint_errors import CheckpointUnsafe
    from disttrain.checkpoint.metadata_pickle import MetadataUnpickler

    index = MetadataIndex("model.w", [0], 0)
    good = pickle.dumps(index)
    assert MetadataUnpickler(io.BytesIO(good), tmp_path / ".metadata").load() == index
    extra = good.replace(b"\x8c\x05index", b"\x8c\x05xndex")  # a field it does not declare
    with pytest.raises(CheckpointUnsafe, match="not the fields it declares"):
        MetadataUnpickler(io.BytesIO(extra), tmp_path / ".metadata").load()
    assert not hasattr(MetadataIndex("model.w", [0], 0), "xndex")


def _unpickler(data: bytes):
    import io

    from disttrain.checkpoint.metadata_pickle import MetadataUnpickler

    return MetadataUnpickler(io.BytesIO(data), pathlib.Path("step/.metadata"))


def _shared(levels: int):
    """`levels` lists, each holding the one below twice: 2**levels paths, levels objects."""
    value: object = 0
    for _ in range(levels):
        value = [value, value]
    return value


def test_the_unpickler_checks_a_shared_object_once_not_once_per_path():
    """A few hundred bytes whose memo shares one list down 18 levels (2**18 paths) are
    checked by visiting each object about once; 40 levels are refused for depth."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    from disttrain.checkpoint.checkpoint_errors import CheckpointUnsafe

    data = pickle.dumps(Metadata(state_dict_metadata={}, planner_data=_shared(18)), protocol=2)
    unpickler = _unpickler(data)
    before = unpickler.visits_left
    assert unpickler.load().planner_data == _shared(18)
    assert before - unpickler.visits_left < 200
    deep = pickle.dumps(Metadata(state_dict_metadata={}, planner_data=_shared(40)), protocol=2)
    with pytest.raises(CheckpointUnsafe, match="more than 32 levels deep"):
        _unpickler(deep).load()


def test_the_unpickler_refuses_checks_that_outgrow_the_pickle_and_keys_of_many_paths():
    """Forty objects each handed one shared list of 60,000 items: each BUILD checks the
    list again, more work than the pickle's size allows. A dict key that shares one
    tuple down 24 levels (hashed along every path) is refused before it is hashed."""
    import pickle

    from disttrain.checkpoint.checkpoint_errors import CheckpointUnsafe

    shared = list(range(60_000))
    indexes = [MetadataIndex("w") for _ in range(40)]
    for index in indexes:
        object.__setattr__(index, "fqn", shared)
    with pytest.raises(CheckpointUnsafe, match="more work to check than its size allows"):
        _unpickler(pickle.dumps(indexes, protocol=2)).load()
    key = b"\x80\x02K\x00q\x00" + b"".join(b"h%ch%c\x86q%c" % (i, i, i + 1) for i in range(24))
    with pytest.raises(CheckpointUnsafe, match="a key of more than"):
        _unpickler(key + b"}h\x18K\x00s.").load()


def test_a_list_nested_after_its_check_is_refused_in_one_line(tmp_path, capsys):
    """A dict handed to BUILD stays in the memo; a later SETITEM puts a list 1,500 deep
    into it. The whole result is checked after loading: one line, no RecursionError."""
    import struct

    from disttrain.checkpoint import dcp_read, metadata_bounds
    from disttrain.checkpoint.checkpoint_errors import CheckpointUnsafe

    def text(s: str) -> bytes:
        return b"X" + struct.pack("<I", len(s)) + s.encode()

    data = b"\x80\x02}q\x010ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81}("
    data += text("state_dict_metadata") + b"}" + text("planner_data") + b"h\x01" + text("storage_data") + b"}ub"
    data += b"q\x030h\x01" + text("x") + b"(" + b"(" * 1500 + b"l" * 1500 + b"ls0h\x03."
    step = _copy(tmp_path)
    _replace(step, ".metadata", data)
    with pytest.raises(CheckpointUnsafe, match="more than 32 levels deep"):
        dcp_read.read_metadata(step)
    _one_line(_cli(capsys, "ckpt", "verify", step), str(step / ".metadata"), "refused")
    deep: list = []
    for _ in range(3000):
        deep = [deep]
    assert metadata_bounds._shown(deep).startswith("[[[") and metadata_bounds._shown(_shared(60)).startswith("[[")


def test_json_depth_of_an_open_string_of_escaped_quotes_is_linear():
    """An unclosed string of 150,000 escaped quotes before 70 brackets: each quote used
    to start a scan to the end (quadratic, minutes); now one scan, well inside 20 s."""
    code = (
        "from disttrain import json_text\n"
        "text = '\"' + '\\\\\"' * 150_000 + '[' * 70\n"
        "assert json_text.depth(text) == 0\n"
        "assert json_text.depth('{\"a\\\\\"[\": [[1, \"]\"]], \"b\": {}}') == 3\n"
        "try:\n    json_text.loads(text)\nexcept ValueError as e:\n    print('refused', type(e).__name__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=20, env=worker_env(), cwd=ROOT
    )
    assert proc.returncode == 0 and "refused JSONDecodeError" in proc.stdout, proc.stderr[-2000:]


# ---------------------------------------------------------------- one line per input


def _metadata_json(step):
    return json.loads((step / ".metadata").read_bytes())


def _first_extent(doc, key):
    fqn = sorted(doc["tensors"])[0] if key == "tensor" else sorted(doc["objects"])[0]
    return doc["tensors"][fqn]["chunks"][0] if key == "tensor" else doc["objects"][fqn]


def _nest(doc):
    doc["paths"] = "@@"
    return json.dumps(doc).replace('"@@"', "[" * 100_000 + "]" * 100_000).encode()


def _with(change):
    def make(doc):
        change(doc)
        return json.dumps(doc).encode()

    return make


METADATA_CASES = {
    "a nesting bomb": _nest,
    "offset Infinity": _with(lambda d: _first_extent(d, "tensor").update(offset=float("inf"))),
    "an empty paths list": _with(lambda d: d["paths"].update({k: [] for k in d["paths"]})),
    "a list where a record should be": _with(lambda d: d.update(tensors=[1, 2])),
    "a value length of 1 GiB": _with(lambda d: _first_extent(d, "object").update(length=1 << 30)),
    "a tensor size past its chunks": _with(
        lambda d: [t.update(size=[1 << 40] * len(t["size"])) for t in d["tensors"].values()]
    ),
    "a huge list index": _with(lambda d: d["paths"].update({k: ["optim", 10**12] for k in list(d["paths"])[:1]})),
}


@pytest.mark.parametrize("case", sorted(METADATA_CASES))
def test_a_malformed_raw_metadata_is_one_line_for_verify_inspect_and_a_load(tiny_checkpoint, tmp_path, capsys, case):
    step = checkpoint_copy(tiny_checkpoint, tmp_path)[1]
    _replace(step, ".metadata", METADATA_CASES[case](_metadata_json(step)))
    _verify_failed(_cli(capsys, "ckpt", "verify", str(step)), str(step / ".metadata"))
    _one_line(_cli(capsys, "ckpt", "inspect", str(step)), str(step / ".metadata"))


def _state_json(step, change):
    doc = json.loads((step / "state.json").read_text())
    change(doc)
    _replace(step, "state.json", json.dumps(doc).encode())


def _load(capsys, root) -> subprocess.CompletedProcess:
    """A resume (`Checkpointer.load`, what `disttrain train` and `dt.Job` call) of
    `root`, with the CLI's handling of a `UserError`: its status and what it printed."""
    from ckpt_common import build

    from disttrain.checkpoint import Checkpointer
    from disttrain.errors import one_line

    state = build("ddp")
    capsys.readouterr()
    with one_line("load") as result:
        Checkpointer(root).load(state)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["load"], result.code, out, err)


def test_a_string_step_in_state_json_is_one_line_on_resume(tiny_checkpoint, tmp_path, capsys):
    step = checkpoint_copy(tiny_checkpoint, tmp_path)[1]
    _state_json(step, lambda d: d.update(step="seven"))
    _one_line(_load(capsys, step.parent), "state.json", "step")


def test_a_nesting_bomb_in_state_json_and_a_bad_rng_file_are_one_line_on_resume(tiny_checkpoint, tmp_path, capsys):
    step = checkpoint_copy(tiny_checkpoint, tmp_path)[1]
    _replace(step, "state.json", b"[" * 100_000 + b"]" * 100_000)
    _one_line(_load(capsys, step.parent), "state.json")
    step = checkpoint_copy(tiny_checkpoint, tmp_path / "again")[1]
    rng = json.loads((step / "rank-00000.json").read_text())
    rng["torch"]["__tensor__"] = "AAAA"
    _replace(step, "rank-00000.json", json.dumps(rng).encode())
    _one_line(_load(capsys, step.parent), "rank-00000.json")


def test_a_malformed_writer_lease_and_manifest_records_are_one_line(tiny_checkpoint, tmp_path, capsys):
    step = checkpoint_copy(tiny_checkpoint, tmp_path)[1]
    (step.parent / "WRITER.json").write_text('{"run_id": 5, "generation": "x"}')
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"]["state.json"] = [1, 2]
    (step / "manifest.json").write_text(json.dumps(manifest))
    _verify_failed(_cli(capsys, "ckpt", "verify", str(step.parent)), "manifest.json", "state.json")
    manifest["files"]["state.json"] = {"size": 3, "digest": "md5:00"}
    (step / "manifest.json").write_text(json.dumps(manifest))
    _verify_failed(_cli(capsys, "ckpt", "verify", str(step)), "manifest.json", "md5")


@pytest.mark.parametrize("where", ["file", "override"])
def test_a_toml_nesting_bomb_is_one_line(tmp_path, capsys, where):
    bomb = "[" * 20_000 + "]" * 20_000  # (an argument of the command line: under its limit)
    config = tmp_path / "c.toml"
    config.write_text(f"[train]\nsteps = {bomb}\n" if where == "file" else "[train]\nsteps = 2\n")
    args = ["train", str(config)] + ([f"--train.steps={bomb}"] if where == "override" else [])
    _one_line(_cli(capsys, *args), "nests", "c.toml" if where == "file" else "override")


def test_report_takes_bad_values_and_invalid_utf8_and_20k_restarts_in_seconds(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "loss": 1.0, "world_size": "two", "step_time_s": ["x"], "peak_mem_mb": ["y"],
                "tokens_per_s": 10**400 if s == 1 else 5.0} for s in range(1, 20_002)]  # fmt: skip
    text = "".join(json.dumps(r) + "\n" for r in records)
    (run / "metrics.jsonl").write_bytes(text.encode() + b'{"step": 3, "loss": "\xff\xfe"}\n' + b"[" * 10**5 + b"\n")
    events = [{"attempt": a, "step": a, "world_size": "x" if a % 2 else 1} for a in range(20_000)]
    (run / "run_events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    proc = _cli(capsys, "report", str(run))  # was minutes: one line and one label per mark
    assert proc.returncode == 0, proc.stderr[-3000:]
    side = json.loads((run / "report.json").read_text())
    assert side["attempts"] == 20_000 and side["skipped_lines"] == [20_003]


def test_a_saved_lr_of_zero_resumes_with_the_new_lr():
    from disttrain.train import resume_plan

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    fresh = resume_plan.fresh_hyperparams(torch.optim.SGD(model.parameters(), lr=0.1), sched) | {"base_lrs": [0.1]}
    plan = resume_plan.ResumePlan("ckpt/step-00000001", 1, {"optim": {"lr": 0.0}}, changes=[("optim.lr", 0.0, 0.1)])
    resume_plan.apply(plan, opt, sched, fresh)
    assert sched.base_lrs == [0.1] and opt.param_groups[0]["lr"] == pytest.approx(0.1)


# ---------------------------------------------------------------- the fuzz run


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def test_fuzz_checkpoints_runs_and_configs_end_in_success_or_one_line(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, str(WORKERS / "fuzz_inputs.py"), str(FUZZ_SEED), str(FUZZ_CASES), str(work)],
        capture_output=True, text=True, env=worker_env(), timeout=200, preexec_fn=_limited, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["cases"] == FUZZ_CASES
    assert result["failures"] == [], "\n".join(result["failures"][:30])
    assert result["secret_seen"] == 0
    assert result["slowest_s"] < 10
