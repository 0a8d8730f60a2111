"""The objects a rank keeps for life leave the garbage collector (`freeze_long_lived`):
`init` freezes torch's imports, the first `Checkpointer` DCP's, and `shutdown` gives
them back. Without it a full automatic collection (0.2-0.3 s with torch and DCP
imported, on 2 cores) fell inside about every fourth checkpoint load, and the other
ranks waited for it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from conftest import worker_env

SCRIPT = r"""
import gc, json, sys
import torch
import disttrain as dt
from disttrain.checkpoint import Checkpointer, TrainState
from disttrain.runtime import shutdown

if sys.argv[2] == "frozen":  # as a warm worker or a fast-recovery rank starts: frozen for life
    gc.freeze()
out = {"before": gc.get_freeze_count()}
dt.init(seed=0)
out["after_init"] = gc.get_freeze_count()
model = torch.nn.Linear(4, 4)
state = TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))
ck = Checkpointer(sys.argv[1], keep_last=1)
out["after_checkpointer"] = gc.get_freeze_count()
state.step = 1
ck.save(state)
with torch.no_grad():
    model.weight.zero_()
ck.load(state)
out["loaded"] = bool(model.weight.abs().sum() > 0)
ck.close()
shutdown()
out["after_shutdown"] = gc.get_freeze_count()
print(json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, mode: str) -> dict:
    env = worker_env(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ck"), mode], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_init_and_the_first_checkpointer_freeze_what_lives_as_long_as_the_rank(tmp_path):
    out = _run(tmp_path, "plain")
    assert out["before"] == 0
    assert out["after_init"] > 50_000  # torch's imports: about 160,000 objects
    assert out["after_checkpointer"] > out["after_init"] + 20_000  # DCP's: about 110,000 more
    assert out["loaded"]  # a load is unchanged by the freeze
    assert out["after_shutdown"] == 0  # nothing stays out of the collector's reach after the group


def test_a_process_frozen_before_init_stays_frozen_after_shutdown(tmp_path):
    """A warm worker freezes its parent's imports so that its collections, the one in
    `shutdown` included, scan only what it made: `shutdown` must not thaw them."""
    out = _run(tmp_path, "frozen")
    assert out["before"] > 50_000
    assert out["loaded"]
    assert out["after_checkpointer"] > out["before"]
    assert out["after_shutdown"] > out["before"]  # still frozen (objects freed by refcount leave it)
