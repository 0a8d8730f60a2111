"""load-without-map-location, load-without-weights-only: how a checkpoint is read back.

Each test is a small script written for this suite: the pitfall the rule must flag, or a
look-alike it must leave alone. A comment may name the public project whose review
showed the case (a fact); the code is ours.
"""

from __future__ import annotations

import textwrap

from rule_check import PRE, found

# ml-4m: safetensors' own `torch` module is not torch
SAFETENSORS_LOAD = PRE + """
from safetensors.torch import load as load_st
with open("weights.safetensors", "rb") as fh:
    weights = load_st(fh.read())
"""

# verl: each rank loads back its own shard, saved offloaded to the CPU
OWN_SHARD_LOAD = PRE + """
remote = os.path.join(folder, f"shard_{rank}_of_{world}.pt")
here = fetch_copy(remote)
state = torch.load(here, weights_only=False)
"""

# OLMo-core: each rank reads back its own trainer state, named in a for loop
LOOP_NAMED_LOAD = PRE + """
for candidate in (f"{d}/shards/part{dist.get_rank()}.pt", f"{d}/shards/part0.pt"):
    try:
        state = torch.load(candidate, weights_only=False)
        break
    except OSError:
        continue
"""

# ddim: one process driving every GPU through DataParallel
ONE_PROCESS_DP = """
import torch
net = torch.nn.DataParallel(make_net().to("cuda"))
saved = torch.load("weights.pt")
"""

# HALOs: the resume reads scheduler.pt (a SequentialLR's state, no tensor) beside the
# optimizer's state (GPU tensors)
SCHEDULER_STATE = PRE + """
def restore(folder, opt, sched):
    opt.load_state_dict(torch.load(os.path.join(folder, "opt.pt"), weights_only=True))
    sched.load_state_dict(torch.load(os.path.join(folder, "scheduler.pt"), weights_only=True))
restore("state", None, None)
"""


def test_an_object_broadcast_through_a_buffer_needs_no_map_location():
    # ClassyVision's broadcast_object: torch.load of a BytesIO / a TemporaryFile of the bytes
    src = textwrap.dedent("""
    import io, tempfile, torch
    def unpack(payload, spill):
        if spill:
            with tempfile.TemporaryFile() as scratch:
                scratch.write(payload)
                scratch.seek(0)
                value = torch.load(scratch)
        else:
            value = torch.load(io.BytesIO(payload))
        return value
    """)
    assert found(src, "load-without-map-location") == []
    assert len(found(src, "load-without-weights-only")) == 2  # still unpickled
    assert found("import torch\nsd = torch.load('ckpt.pt')\n", "load-without-map-location")


def test_safetensors_load_is_not_torch_load():
    assert found(SAFETENSORS_LOAD, "load-without-weights-only") == []
    assert found(SAFETENSORS_LOAD, "load-without-map-location") == []
    plain = SAFETENSORS_LOAD.replace(
        "from safetensors.torch import load as load_st", "from torch import load as load_st"
    )
    assert [f[0] for f in found(plain, "load-without-weights-only")] == ["load-without-weights-only"]


def test_a_per_rank_shard_needs_no_map_location():
    assert found(OWN_SHARD_LOAD, "load-without-map-location") == []
    shared = OWN_SHARD_LOAD.replace('f"shard_{rank}_of_{world}.pt"', '"model.pt"')
    assert found(shared, "load-without-map-location") != []


def test_a_per_rank_file_named_by_a_loop_needs_no_map_location():
    assert found(LOOP_NAMED_LOAD, "load-without-map-location") == []


def test_a_single_process_data_parallel_script_needs_no_map_location():
    assert found(ONE_PROCESS_DP, "load-without-map-location") == []


def test_a_scheduler_state_needs_no_map_location():
    assert [f[1] for f in found(SCHEDULER_STATE, "load-without-map-location")] == [13]
