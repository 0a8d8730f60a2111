"""Start-up: what each rank of `disttrain train` imports before its first step.

`python -m disttrain.train` imports `disttrain.train.trainer`; every start and every
restart pays for what that pulls in. The modules below cost about half a second
together (DCP pulls in DTensor, whose sharding rules import sympy) and none is
needed before the first step of a fresh run: they load on first use (the first
checkpoint save or load, an FSDP wrap, the progress bar, an export).
"""

import json
import subprocess
import sys

import pytest

KEPT_OUT = [
    "torch.distributed.checkpoint",  # DCP: on the first save or load
    "torch.distributed.tensor",  # DTensor (imports sympy): with DCP or FSDP
    "torch.distributed.fsdp",  # only under parallel.strategy = "fsdp"
    "sympy",
    "rich",  # the progress bar and summary, on rank 0, when the run starts / ends
    "safetensors",  # exports
    "transformers",  # model.hf only
    "matplotlib",
]

# one fresh interpreter: the modules loaded after the start-up imports, then after the
# checkpoint writer's DCP path (which must show up, or the probe could not fail)
_PROBE = """
import json, sys
def loaded():
    return sorted(m for m in sys.modules if m.split('.')[0] in {roots!r} or m.startswith('torch.distributed.'))
import disttrain.train.trainer, disttrain.train.job
start = loaded()
import disttrain.checkpoint.dcp_read
print(json.dumps([start, loaded()]))
"""


@pytest.fixture(scope="module")
def loaded() -> tuple[set[str], set[str]]:
    roots = sorted({name.split(".")[0] for name in KEPT_OUT} - {"torch"})
    out = subprocess.run([sys.executable, "-c", _PROBE.format(roots=roots)],
                         capture_output=True, text=True, timeout=120, check=True)
    start, later = json.loads(out.stdout.strip().splitlines()[-1])
    return set(start), set(later)


def _heavy(modules: set[str]) -> list[str]:
    return sorted(name for name in KEPT_OUT
                  if any(m == name or m.startswith(name + ".") for m in modules))


def test_start_up_imports_no_heavy_module(loaded):
    heavy = _heavy(loaded[0])
    assert heavy == [], (f"`import disttrain.train.trainer, disttrain.train.job` loads {heavy}: "
                         f"move that import into the function that needs it (first use), with "
                         f"a comment saying why")


def test_the_probe_sees_a_heavy_import(loaded):
    assert "torch.distributed.checkpoint" in _heavy(loaded[1])
