"""One program per entry point: a folder checked as one run is split by its entry points
(`__main__` blocks, console scripts, scripts named on the command line, module-level
scripts), each with the files it imports. What one script sets up is never lent to
another, and a finding names the program(s) it holds in.

Each script is ours, written for this suite.
"""

from __future__ import annotations

import json
import textwrap

from rule_check import found_in

from disttrain.doctor.analyzer import analyze_paths
from disttrain.doctor.doctor_report import render_json

HEAD = """
import datetime, os, torch, torch.distributed as dist
from ckpt_util import save_weights
"""

INIT = """
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
"""

# one script shards with FSDP1 ...
SHARDED = HEAD + """
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

def build(net):
    return FSDP(net)

def main():""" + INIT + """
    model = build(torch.nn.Linear(4, 4).cuda())
    save_weights(model, "sharded.pt")

if __name__ == "__main__":
    main()
"""

# ... the other replicates with DDP, where a plain GradScaler is right
SCALED = HEAD + """
from torch.nn.parallel import DistributedDataParallel as DDP

def main():""" + INIT + """
    model = DDP(torch.nn.Linear(4, 4).cuda())
    scaler = torch.cuda.amp.GradScaler()
    for step in range(3):
        with torch.autocast("cuda"):
            loss = model(torch.ones(4).cuda()).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    save_weights(model, "scaled.pt")

if __name__ == "__main__":
    main()
"""

SHARED = """
import torch

def save_weights(model, path):
    torch.save(model.state_dict(), path)
"""


def test_two_entry_scripts_are_two_programs_and_a_shared_module_is_reported_once(tmp_path):
    files = {"sharded.py": SHARDED, "scaled.py": SCALED, "ckpt_util.py": SHARED}
    # the FSDP of one script is not the other's: its plain scaler over DDP is right
    assert found_in(tmp_path, files, "gradscaler-unsynced") == []
    listed, fs = analyze_paths([str(tmp_path)])
    [save] = [f for f in fs if f.rule == "non-atomic-save"]  # judged in both, said once
    assert save.program == (str(tmp_path / "scaled.py"), str(tmp_path / "sharded.py"))
    [doc] = [d for d in json.loads(render_json(listed, fs))["findings"] if d["rule"] == "non-atomic-save"]
    assert doc["program"] == list(save.program)


def test_the_same_scripts_as_one_program_keep_the_defect(tmp_path):
    # the look-alike: the scaled script builds its model with the sharded one's FSDP
    joined = SCALED.replace("from torch.nn.parallel import DistributedDataParallel as DDP",
                            "from sharded import build").replace("DDP(torch", "build(torch")
    files = {"sharded.py": SHARDED, "scaled.py": joined, "ckpt_util.py": SHARED}
    [(name, _, _, severity)] = found_in(tmp_path, files, "gradscaler-unsynced")
    assert (name, severity) == ("scaled.py", "error")
    _, fs = analyze_paths([str(tmp_path)])
    [f] = [f for f in fs if f.rule == "gradscaler-unsynced"]
    assert f.program == (str(tmp_path / "scaled.py"),)


def test_console_scripts_and_module_level_scripts_are_entry_points(tmp_path):
    # a package's console script and a loose script without a __main__ block: two
    # programs, so the script's FSDP is not the package trainer's
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n[project.scripts]\nfit = "pkg.fit:main"\n')
    fit = SCALED.replace("from ckpt_util import save_weights", "from pkg.ckpt_util import save_weights")
    loose = textwrap.dedent(SHARDED).replace('if __name__ == "__main__":\n    ', "")
    files = {"pkg/__init__.py": "", "pkg/fit.py": fit.replace('if __name__ == "__main__":\n    main()\n', ""),
             "pkg/ckpt_util.py": SHARED, "ckpt_util.py": SHARED, "loose.py": loose}
    assert found_in(tmp_path, files, "gradscaler-unsynced") == []
    _, fs = analyze_paths([str(tmp_path)])
    programs = {f.program for f in fs if f.rule == "non-atomic-save"}
    assert programs == {(str(tmp_path / "loose.py"),), (str(tmp_path / "pkg" / "fit.py"),)}


def test_a_file_no_entry_point_reaches_is_judged_with_the_whole_run(tmp_path):
    # the trainer is built through a registry that was not checked: no import reaches
    # it, so the entry script's device bind stays in view, as before programs
    entry = HEAD.replace("from ckpt_util import save_weights\n", "") + "def main():" + INIT + """
    build_from_registry("trainer")

if __name__ == "__main__":
    main()
"""
    trainer = ("import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
               "class Trainer:\n    def fit(self, net):\n        self.net = DDP(net.to(torch.device('cuda')))\n")
    files = {"run.py": entry, "trainers/base.py": trainer}
    assert found_in(tmp_path, files, "missing-set-device") == []
    # the look-alike: without the entry script, nothing in view binds the device
    alone = found_in(tmp_path / "alone", {"trainers/base.py": trainer}, "missing-set-device")
    assert [(g[0], g[3]) for g in alone] == [("base.py", "warning")]
