"""One way to see through a wrapper: `torch_compat.unwrap`, `canonical_name` and
`wrapper_kind`, and the weight-decay groups built on them (`parallel.optimizers`).

Every wrapper kind that runs on a CPU is built for real, nothing is mocked: torch.compile
(its `OptimizedModule`, not traced: no forward runs), DDP and FSDP1 over a one-process
gloo group, DataParallel (no GPU: it calls its module), the activation-checkpoint
wrapper around the whole model or around each block, and nestings of them. The model
has a submodule of its own named `module` deep inside, which DDP's `module.` must not
be confused with.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import disttrain as dt
from disttrain.checkpoint.files import load_model
from disttrain.checkpoint.state import TrainState
from disttrain.parallel.compile import plain_module
from disttrain.parallel.optimizers import decay_groups, decaying
from disttrain.runtime import torch_compat
from disttrain.runtime.torch_compat import canonical_name, unwrap, wrapper_kind


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(8, 8)  # the user's own name, not DDP's
        self.ln = nn.LayerNorm(8)

    def forward(self, x):
        return x + self.module(self.ln(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.frozen = nn.Parameter(torch.zeros(8, 8), requires_grad=False)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, idx):
        x = self.emb(idx) * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-process gloo group for DDP and FSDP1, taken down after this module."""
    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _ddp(m: nn.Module) -> nn.Module:
    return nn.parallel.DistributedDataParallel(m)


def _fsdp1(m: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    units = {torch_compat.checkpoint_wrapper_class()} if any(
        wrapper_kind(b) == "checkpoint" for b in m.modules()) else {Block}
    return FullyShardedDataParallel(m, device_id=torch.device("cpu"), use_orig_params=True,
                                    auto_wrap_policy=ModuleWrapPolicy(units))


def _checkpoint_blocks(m: nn.Module) -> nn.Module:
    for i, block in enumerate(m.blocks):
        m.blocks[i] = torch_compat.checkpoint_wrap(block)
    return m


# name -> (how to wrap the plain model, the outermost wrapper's kind)
WRAPPINGS: dict[str, tuple[Callable[[nn.Module], nn.Module], str | None]] = {
    "compile": (torch.compile, "compile"),
    "ddp": (_ddp, "ddp"),
    "fsdp1": (_fsdp1, "fsdp1"),
    "dp": (nn.DataParallel, "dp"),
    "checkpoint": (torch_compat.checkpoint_wrap, "checkpoint"),
    "checkpointed blocks": (_checkpoint_blocks, None),
    "compile(ddp)": (lambda m: torch.compile(_ddp(m)), "compile"),
    "ddp(compile)": (lambda m: _ddp(torch.compile(m)), "ddp"),
    "compile(dp)": (lambda m: torch.compile(nn.DataParallel(m)), "compile"),
    "ddp(checkpointed blocks)": (lambda m: _ddp(_checkpoint_blocks(m)), "ddp"),
    "fsdp1(checkpointed blocks)": (lambda m: _fsdp1(_checkpoint_blocks(m)), "fsdp1"),
    "compile(fsdp1)": (lambda m: torch.compile(_fsdp1(m)), "compile"),
    "checkpoint(compile(ddp))": (lambda m: torch_compat.checkpoint_wrap(torch.compile(_ddp(m))), "checkpoint"),
}


def _plain_names(m: nn.Module) -> tuple[list[str], list[str]]:
    return [n for n, _ in m.named_parameters()], [n for n, _ in m.named_buffers()]


@pytest.mark.parametrize("how", list(WRAPPINGS))
def test_unwrap_returns_the_original_module_and_names_are_the_plain_models(group, how):
    wrap, kind = WRAPPINGS[how]
    model = Net()
    params, buffers = _plain_names(model)
    wrapped = wrap(model)
    assert wrapper_kind(wrapped) == kind
    assert unwrap(wrapped) is model
    assert dt.unwrap(wrapped) is model and dt.unwrap is unwrap
    raw = [n for n, _ in wrapped.named_parameters()]
    if kind not in (None, "checkpoint"):  # a root checkpoint wrapper names its parameters itself
        assert raw != params, "the wrapping was expected to change the names"
    assert [canonical_name(n) for n in raw] == params
    assert [canonical_name(n) for n, _ in wrapped.named_buffers()] == buffers
    assert [canonical_name(n) for n, _ in unwrap(wrapped).named_parameters()] == params
    assert "blocks.0.module.weight" in params  # the user's own `module` survived


@pytest.mark.parametrize("how", list(WRAPPINGS))
def test_decay_groups_of_a_wrapped_model_are_the_plain_models(group, how):
    plain = [(n, d) for n, _, d in decaying(Net())]
    assert ("head.weight", True) in plain and ("norm.weight", False) in plain
    assert ("blocks.1.module.weight", True) in plain and ("blocks.1.module.bias", False) in plain
    assert "frozen" not in [n for n, _ in plain] and "emb.weight" in [n for n, _ in plain]

    wrapped = WRAPPINGS[how][0](Net())
    named = decaying(wrapped)
    assert [(n, d) for n, _, d in named] == plain
    name_of = {id(q): n for n, q, _ in named}
    groups = decay_groups(wrapped, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert [name_of[id(q)] for q in groups[0]["params"]] == [n for n, d in plain if d]
    assert [name_of[id(q)] for q in groups[1]["params"]] == [n for n, d in plain if not d]
    own = {id(q) for q in wrapped.parameters()}  # what the optimizer must hold (check_optimizer)
    assert all(id(q) in own for g in groups for q in g["params"])


@pytest.mark.parametrize("name, plain", [
    ("module.blocks.0.weight", "blocks.0.weight"),                       # DDP, DataParallel
    ("_orig_mod.module.blocks.0.weight", "blocks.0.weight"),             # compile(DDP)
    ("module._orig_mod.blocks.0.weight", "blocks.0.weight"),             # DDP(compile)
    ("_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.weight", "blocks.0.weight"),
    ("blocks.0._checkpoint_wrapped_module.weight", "blocks.0.weight"),
    ("module.blocks.0._checkpoint_wrapped_module.module.weight", "blocks.0.module.weight"),
    ("blocks.0.module.weight", "blocks.0.module.weight"),                # the user's own, deep
    ("module.module.weight", "weight"),                                  # leading: cannot tell
    ("weight", "weight"),
])
def test_canonical_name_removes_wrapper_parts_only(name, plain):
    assert canonical_name(name) == plain
    assert canonical_name(plain) == plain  # idempotent


def test_plain_modules_and_fsdp2_like_modules_are_no_wrappers():
    model = Net()
    assert wrapper_kind(model) is None and unwrap(model) is model
    assert torch_compat.inner_module(model) is None


def test_wrap_takes_one_compile_layer_off_so_a_compiled_ddp_is_still_refused(group):
    model = Net()
    ddp = _ddp(model)
    inner, compiled = plain_module(torch.compile(ddp))
    assert compiled and inner is ddp  # not `model`: wrap then refuses the nested DDP
    assert plain_module(model) == (model, False)


def test_a_state_dict_saved_from_a_wrapped_model_loads_into_the_plain_one(group, tmp_path):
    source = Net()
    with torch.no_grad():
        source.head.weight.fill_(0.5)
    path = tmp_path / "wrapped.pt"
    torch.save(torch.compile(_ddp(source)).state_dict(), path)  # `_orig_mod.module.` keys
    assert all(k.startswith("_orig_mod.module.") for k in torch.load(path, weights_only=True))
    target = Net()
    load_model(_ddp(target), path)
    assert torch.equal(target.head.weight, source.head.weight)
    assert torch.equal(target.blocks[1].module.weight, source.blocks[1].module.weight)


def test_a_models_own_leading_module_keeps_its_name_when_loading(tmp_path):
    outer = nn.Sequential()
    outer.module = nn.Linear(3, 3)  # the user's own top-level `module`
    path = tmp_path / "plain.pt"
    torch.save(outer.state_dict(), path)
    target = nn.Sequential()
    target.module = nn.Linear(3, 3)
    load_model(target, path)
    assert torch.equal(target.module.weight, outer.module.weight)
    torch.save(nn.DataParallel(outer).state_dict(), path)  # `module.module.weight`
    target.module.reset_parameters()
    load_model(target, path)
    assert torch.equal(target.module.weight, outer.module.weight)


def test_strip_prefix_removes_exactly_one_given_prefix():
    state = {"module.module.w": 1, "hf.x": 2, "y": 3}
    assert dt.checkpoint.strip_prefix(state) == {"module.w": 1, "hf.x": 2, "y": 3}
    assert dt.checkpoint.strip_prefix(state, "hf.") == {"module.module.w": 1, "x": 2, "y": 3}


def test_a_dataparallel_checkpoint_has_the_plain_models_keys():
    model = Net()
    keys = set(TrainState(model=nn.DataParallel(model)).tensor_state()["model"])
    assert keys == set(model.state_dict())
