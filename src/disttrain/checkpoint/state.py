"""Everything a resume needs, behind one `state_dict` (P-CKPT-1, P-LOOP-6).

`TrainState` holds the model, optimizer, LR scheduler, grad scaler, sampler,
epoch, global step, user extras (EMA weights) and the resolved config. Its
`state_dict()` has three parts, stored differently on disk:

- `tensors`: model and optimizer (through torch's `get_state_dict`, so the same
  code serves DDP, FSDP2 and a plain module, with prefix-free names) and tensor
  extras. Saved by DCP, sharded, reshardable on load. A ZeRO-1 optimizer is seen
  through `zero_state.ZeroView`: each rank saves and loads the state of the
  parameters it owns, in the same fqn-keyed format (no consolidation).
- `meta`: global plain data (step, epoch, scheduler, scaler, sampler, config,
  non-tensor extras). Saved as JSON by rank 0: nothing to unpickle.
- `rng`: this rank's Python, NumPy, torch CPU and CUDA generator states. Saved as
  JSON, one file per rank, since each rank has its own dropout stream.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from disttrain.checkpoint.zero_state import ZeroView, is_zero
from disttrain.parallel.mesh import TP
from disttrain.runtime import torch_compat


def strategy_of(model: torch.nn.Module) -> str:
    """'fsdp', 'ddp', 'dp' or 'single', from the module's wrapper type."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules()):
        return "fsdp"
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    return "dp" if isinstance(model, DataParallel) else "single"


def tp_degree(model: torch.nn.Module) -> int:
    """The tensor-parallel degree `model` was split with: the size of the `tp` dimension
    of a parameter's device mesh (`parallel.mesh`); 1 when none has one."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        names = getattr(mesh, "mesh_dim_names", None) or ()
        if mesh is not None and TP in names:
            return int(mesh.size(names.index(TP)))
    return 1


# ---------------------------------------------------------------- plain data <-> JSON


def to_jsonable(obj: Any) -> Any:
    """Plain data for JSON: tuples become lists, tensors and arrays become tagged
    base64 records. Floats survive exactly (JSON writes their shortest repr)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        return {
            "__tensor__": base64.b64encode(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").decode(),
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
        }
    if type(obj).__module__ == "numpy" and hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(
        f"cannot store a {type(obj).__name__} in checkpoint JSON; keep extras "
        f"to tensors, modules, and plain numbers/strings/lists/dicts."
    )


def from_jsonable(obj: Any) -> Any:
    """Inverse of `to_jsonable` for tensors; lists stay lists. Raises `ValueError` for a
    tensor record whose shape does not hold exactly its bytes (nothing is allocated
    beyond them) or whose dtype is not torch's."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            from disttrain.checkpoint.json_records import dtype_of

            dtype, shape = dtype_of(obj["dtype"]), obj["shape"]
            raw = bytearray(base64.b64decode(obj["__tensor__"]))
            if not all(type(n) is int and n >= 0 for n in shape) or math.prod(shape) * dtype.itemsize != len(raw):
                raise ValueError(f"a tensor of shape {str(shape)[:60]} and dtype {dtype} in {len(raw)} bytes")
            if not raw:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
        return {k: from_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_jsonable(v) for v in obj]
    return obj


def config_hash(config: Any) -> str:
    """sha256 of the resolved config's canonical JSON (first 16 hex digits)."""
    data = json.dumps(to_jsonable(config), sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()[:16]


# ---------------------------------------------------------------- RNG


def rng_state() -> dict:
    """This process's Python, NumPy, torch CPU and (when present) CUDA RNG states."""
    state = {"python": to_jsonable(random.getstate()), "torch": to_jsonable(torch.get_rng_state())}
    try:
        import numpy as np

        state["numpy"] = to_jsonable(np.random.get_state())
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [to_jsonable(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` captured; missing parts are left alone."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(from_jsonable(state["torch"]))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([from_jsonable(s) for s in state["cuda"]])


# ---------------------------------------------------------------- the state


@dataclass(kw_only=True)
class TrainState:
    """The complete training state. Pass it to `dt.save` / `dt.load`.

    Holds the objects themselves: saving reads their `state_dict()`s (and every RNG of
    this rank), loading writes into them in place, so build the model, optimizer,
    scheduler and sampler first, exactly as for a fresh start. `extras` maps names to
    modules (EMA weights), tensors, dicts of tensors or plain JSON data. `config` is
    the resolved config (a dataclass or dict); it is saved and hashed into the
    manifest. `step` and `epoch` are the caller's counters: set `step` before saving;
    read it after loading. A checkpoint of another model (different keys or shapes)
    is refused by the load with `CheckpointMismatch`.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    scaler: Any = None
    sampler: Any = None
    extras: dict[str, Any] = field(default_factory=dict)
    config: Any = None
    step: int = 0
    epoch: int = 0

    def _optims(self) -> list:
        """The optimizer as torch's state-dict helpers should see it: a ZeRO-1 optimizer
        through `ZeroView` (this rank's partition, no consolidation)."""
        if self.optimizer is None:
            return []
        return [ZeroView(self.optimizer) if is_zero(self.optimizer) else self.optimizer]

    def _module(self) -> torch.nn.Module:
        """The model as torch's state-dict helpers should see it. They strip the names
        of DDP, FSDP, compile and the checkpoint wrapper themselves (and FSDP needs its
        root to gather), but not DataParallel's `module.`, which would make a dp
        checkpoint load into no other strategy (P-CKPT-4): under DataParallel, which
        shards nothing, the unwrapped module."""
        m = self.model
        return torch_compat.unwrap(m) if torch_compat.wrapper_kind(m) == "dp" else m

    def tensor_state(self) -> dict:
        """`state_dict()["tensors"]` alone (what a load reads into: the other parts are
        read from their files). A collective under FSDP, as `state_dict`."""
        return self._tensor_parts()

    def _tensor_parts(self) -> dict:
        # DCP's helpers pull in DTensor and sympy: imported on the first save, not at start-up
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(strict=True)
        optims = self._optims()
        model_sd, optim_sd = get_state_dict(self._module(), optims, options=opts)
        tensors: dict[str, Any] = {"model": model_sd}
        if self.optimizer is not None:
            tensors["optim"] = optim_sd
        extras: dict[str, Any] = {}
        for name, value in self.extras.items():
            if isinstance(value, nn.Module):
                extras[name] = value.state_dict()
            elif isinstance(value, torch.Tensor) or (
                isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values())
            ):
                extras[name] = value
        if extras:
            tensors["extras"] = extras
        return tensors

    def state_dict(self) -> dict:
        """{"tensors": ..., "meta": ..., "rng": ...}; see the module docstring.

        A collective under FSDP (`get_state_dict`): every rank must call it."""
        meta = {
            "step": self.step,
            "epoch": self.epoch,
            "scheduler": to_jsonable(self.scheduler.state_dict()) if self.scheduler else None,
            "scaler": to_jsonable(self.scaler.state_dict()) if self.scaler else None,
            "sampler": to_jsonable(self.sampler.state_dict())
            if self.sampler is not None and hasattr(self.sampler, "state_dict")
            else None,
            "config": to_jsonable(self.config) if self.config is not None else None,
            "extras": {
                k: to_jsonable(v)
                for k, v in self.extras.items()
                if not isinstance(v, (nn.Module, torch.Tensor, dict))
                or (isinstance(v, dict) and not any(isinstance(x, torch.Tensor) for x in v.values()))
            },
        }
        return {"tensors": self._tensor_parts(), "meta": meta, "rng": rng_state()}

    def load_state_dict(self, sd: dict, *, param_fqns: list[list[str]] | None = None) -> None:
        """Restore from `sd` (the shape `state_dict` returns; `rng` may be absent).

        The tensors must already hold the loaded values (DCP loads in place into
        the dict from `state_dict()["tensors"]`); they are handed to the model and
        optimizer through torch's `set_state_dict`. `param_fqns` (`param_fqns(sd)`
        taken before the load) lets a plain or DDP model skip what that would copy
        onto itself (`in_place`): the optimizer then gets torch's own
        `load_state_dict` of the same dict; any other case goes through
        `set_state_dict`.
        """
        tensors, meta = sd["tensors"], sd["meta"]
        self._load_tensors(tensors, param_fqns)
        self._load_extras(tensors, meta)
        self.step, self.epoch = int(meta["step"]), int(meta["epoch"])
        if sd.get("rng") is not None:
            set_rng_state(sd["rng"])

    def _load_tensors(self, tensors: dict, param_fqns: list[list[str]] | None) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
            set_state_dict,
        )

        from disttrain.checkpoint.in_place import model_in_place, optimizer_state

        optims = self._optims()
        if param_fqns is not None and model_in_place(self._module(), tensors["model"]):
            if not optims:
                return  # every tensor already holds its loaded value
            osd = optimizer_state(optims[0], tensors.get("optim", {}), param_fqns)
            if osd is not None:
                optims[0].load_state_dict(osd)  # what set_optimizer_state_dict ends in
                return
        if optims and isinstance(optims[0], ZeroView):
            # Each rank loaded the state of its own partition only, so the optimizer
            # part is not strict (check_compatible already found every key it asked for).
            set_model_state_dict(self._module(), tensors["model"], options=StateDictOptions(strict=True))
            set_optimizer_state_dict(
                self._module(), optims, tensors.get("optim", {}), options=StateDictOptions(strict=False)
            )
        else:
            set_state_dict(
                self._module(),
                optims,
                model_state_dict=tensors["model"],
                optim_state_dict=tensors.get("optim", {}),
                options=StateDictOptions(strict=True),
            )

    def _load_extras(self, tensors: dict, meta: dict) -> None:
        for name, value in tensors.get("extras", {}).items():
            target = self.extras[name]
            if isinstance(target, nn.Module):
                target.load_state_dict(value, strict=True)
            elif isinstance(target, torch.Tensor):
                with torch.no_grad():
                    target.copy_(value)
            else:
                for k, v in value.items():
                    target[k].copy_(v) if isinstance(target.get(k), torch.Tensor) else target.__setitem__(k, v)
        for name, value in (meta.get("extras") or {}).items():
            self.extras[name] = from_jsonable(value)
        if self.scheduler is not None and meta.get("scheduler") is not None:
            self.scheduler.load_state_dict(from_jsonable(meta["scheduler"]))
        if self.scaler is not None and meta.get("scaler") is not None:
            self.scaler.load_state_dict(from_jsonable(meta["scaler"]))
        if self.sampler is not None and meta.get("sampler") is not None:
            self.sampler.load_state_dict(meta["sampler"])


def param_fqns(sd: dict) -> list[list[str]] | None:
    """The fqns of each optimizer group's parameters in `sd` (a `state_dict()`), as
    torch's `get_state_dict` named them; take it before a load replaces the groups."""
    groups = sd["tensors"].get("optim", {}).get("param_groups")
    if not isinstance(groups, list):
        return None
    return [list(g.get("params", ())) for g in groups]
