"""load-without-map-location, load-without-weights-only: how a checkpoint is read back.

Each test is a small script written for this suite: the pitfall the rule must flag, or a
look-alike it must leave alone. A comment may name the public project whose review
showed the case (a fact); the code is ours.
"""

from __future__ import annotations

import textwrap

from rule_check import PRE, found

# ml-4m: safetensors' own `torch` module is not torch
SAFETENSORS = PRE + """
from safetensors.torch import load as load_st
with open("m.safetensors", "rb") as f:
    tensors = load_st(f.read())
"""

# verl: each rank loads back its own shard, saved offloaded to the CPU
VERL_LOAD = PRE + """
path = os.path.join(ckpt, f"model_world_size_{world}_rank_{rank}.pt")
local_path = copy_to_local(path)
state = torch.load(local_path, weights_only=False)
"""

# OLMo-core: each rank reads back its own trainer state, named in a for loop
OLMO_LOAD = PRE + """
for path in (f"{d}/train/rank{dist.get_rank()}.pt", f"{d}/train/rank0.pt"):
    try:
        state = torch.load(path, weights_only=False)
        break
    except FileNotFoundError:
        pass
"""

# ddim: one process driving every GPU through DataParallel
DDIM = """
import torch
model = torch.nn.DataParallel(Model().to("cuda"))
states = torch.load("ckpt.pth")
"""

# HALOs: the resume reads scheduler.pt (a SequentialLR's state, no tensor) beside the
# optimizer's state (GPU tensors)
HALOS = PRE + """
def resume(path, optimizer, scheduler):
    optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=True))
    scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt"), weights_only=True))
resume("ckpt", None, None)
"""


def test_an_object_broadcast_through_a_buffer_needs_no_map_location():
    # ClassyVision's broadcast_object: torch.load of a BytesIO / a TemporaryFile of the bytes
    src = textwrap.dedent("""
    import io, tempfile, torch
    def receive(data, use_disk):
        if use_disk:
            with tempfile.TemporaryFile("r+b") as f:
                f.write(data)
                f.seek(0)
                obj = torch.load(f)
        else:
            buffer = io.BytesIO(data)
            obj = torch.load(buffer)
        return obj
    """)
    assert found(src, "load-without-map-location") == []
    assert len(found(src, "load-without-weights-only")) == 2  # still unpickled
    assert found("import torch\nsd = torch.load('ckpt.pt')\n", "load-without-map-location")


def test_safetensors_load_is_not_torch_load():
    assert found(SAFETENSORS, "load-without-weights-only") == []
    assert found(SAFETENSORS, "load-without-map-location") == []
    plain = SAFETENSORS.replace("from safetensors.torch import load as load_st", "from torch import load as load_st")
    assert [f[0] for f in found(plain, "load-without-weights-only")] == ["load-without-weights-only"]


def test_a_per_rank_shard_needs_no_map_location():
    assert found(VERL_LOAD, "load-without-map-location") == []
    shared = VERL_LOAD.replace('f"model_world_size_{world}_rank_{rank}.pt"', '"model.pt"')
    assert found(shared, "load-without-map-location") != []


def test_a_per_rank_file_named_by_a_loop_needs_no_map_location():
    assert found(OLMO_LOAD, "load-without-map-location") == []


def test_a_single_process_data_parallel_script_needs_no_map_location():
    assert found(DDIM, "load-without-map-location") == []


def test_a_scheduler_state_needs_no_map_location():
    assert [f[1] for f in found(HALOS, "load-without-map-location")] == [13]
