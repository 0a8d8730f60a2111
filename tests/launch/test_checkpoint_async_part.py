"""An async save after the first copies only this rank's part of the state
(`checkpoint.async_part`): at world size 2 under DDP, the third async save of a
checkpointer (a part save) holds exactly the state it was asked to save, bit for bit,
the same as a sync save of that state."""

import json
import subprocess
import sys

from conftest import WORKERS, worker_env

SCRIPT = '''
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from ckpt_common import build, full_state, mismatches, train
import disttrain as dt
from disttrain.checkpoint import Checkpointer

out = Path(sys.argv[1])
with dt.distributed(seed=0) as info:
    state = build("ddp")
    ck = Checkpointer(out / "async", keep_last=2, async_mode="thread")
    sync = Checkpointer(out / "sync", keep_last=2)
    parts = []
    for _ in range(3):
        train(state, 1)
        ck.save(state)
        parts.append(ck._async._paths is not None)
        expected = full_state(state)
        ck.wait()
    sync.save(state)
    train(state, 1)  # the parameters move on after the save
    res = {"part_saves": parts}
    for name in ("async", "sync"):
        fresh = build("ddp")
        res[name + "_loaded"] = dt.load(fresh, out / name).name
        res[name + "_mismatch"] = mismatches(full_state(fresh), expected) if info.rank == 0 else []
        res[name + "_step"] = fresh.step
    ck.close()
    sync.close()
    (out / f"rank{info.rank}.json").write_text(json.dumps(res))
'''


def test_part_saves_hold_the_whole_state_bit_for_bit(tmp_path):
    script = tmp_path / "async_part_worker.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(script), str(tmp_path), str(WORKERS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=worker_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["part_saves"] == [False, True, True]  # the 2nd and 3rd copy a part
        assert res["async_loaded"] == res["sync_loaded"] == "step-00000003"
        assert res["async_step"] == res["sync_step"] == 3
        assert res["async_mismatch"] == res["sync_mismatch"] == []
