"""Every private name of torch (and of the interpreter) that disttrain relies on, in one file.

A private name (one leading underscore, or a module path with such a part) carries no
promise across releases. Each function below is the only place its name is used, says
the releases it was checked on, and what it does when a release no longer has the name:
a public equivalent, a slower exact substitute, or an error that says what is missing.
`tests/policy/test_torch_private.py` fails on a private torch name anywhere else in
`src/disttrain`, so a new release breaks at most this file.

Heavy modules (DCP, FSDP, the checkpoint wrapper, dynamo) are imported inside the
function that needs them: importing this module costs no more than `import torch`.
"""

from __future__ import annotations

import contextlib
import ctypes
import pickle
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeAlias

import torch
import torch.nn as nn

from disttrain.runtime.process_state import STATE

CHECKED_ON = ("2.13.0",)
"""The torch releases every function here was checked on (the suite's pinned release)."""


def process_groups() -> list:
    """Every live process group of this process (`distributed_c10d._world.pg_map`).

    Checked on 2.13.0. Fallback (no `_world`): the default group only, so groups made
    by `new_group` or a DeviceMesh are not seen by the caller's bookkeeping."""
    import torch.distributed as dist

    try:
        from torch.distributed.distributed_c10d import _world

        return list(_world.pg_map)
    except (ImportError, AttributeError):
        return [dist.group.WORLD] if dist.is_initialized() else []


def on_destroy_process_group(hold: Callable[[list], None]) -> None:
    """Wrap `torch.distributed.destroy_process_group` (both names a script can call it
    by: `torch.distributed` and `distributed_c10d`) so that `hold(groups)` receives the
    groups it is about to destroy, before torch drops its own references to them.
    Idempotent.

    Why: after a script's own `destroy_process_group()`, the last reference to a gloo
    group may be a DDP reducer or a DeviceMesh that the script frees later, with the GIL
    held (a `return` from `main()`, `SystemExit` unwinding). The group's destructor then
    joins its worker threads, and a worker still freeing its last collective (whose
    thread-local state holds a Python object) waits for the GIL: the process never
    exits. Holding the groups moves their destruction to a point where no collective
    is pending (`process_group.hold_destroyed`).

    Checked on 2.13.0 (the function reads `_world.pg_map` through `process_groups`).
    Fallback: a release without the function leaves it unwrapped."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = getattr(c10d, "destroy_process_group", None)
    if original is None or getattr(original, "__disttrain_wrapped__", False):
        return

    def destroy_process_group(group: Any = None) -> Any:
        world = group is None or group is getattr(dist.GroupMember, "WORLD", None)
        hold(process_groups() if world else [group])
        return original(group)

    destroy_process_group.__doc__ = original.__doc__
    setattr(destroy_process_group, "__wrapped__", original)  # noqa: B010  (a function typed without it)
    setattr(destroy_process_group, "__disttrain_wrapped__", True)  # noqa: B010
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def make_immortal(obj: Any) -> None:
    """Give `obj` one reference nobody ever drops, so it is never destructed, not even
    during interpreter finalization (`ctypes.pythonapi.Py_IncRef`, CPython only).

    Checked on CPython 3.11 with torch 2.13.0. Fallback (no `pythonapi`, another
    interpreter): the process registry holds it (`process_state.STATE.kept`), which protects
    it until the module globals are cleared late in finalization."""
    try:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    except AttributeError:
        STATE.kept.append(obj)


def unscale_and_check_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply `grads` (one device and dtype) by `inv_scale` in place and set
    `found_inf` to 1 when any of them holds inf or nan
    (`torch._amp_foreach_non_finite_check_and_unscale_`, fused, no host sync).

    Checked on 2.13.0. Fallback: the same result per tensor with public ops."""
    fused = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if fused is not None:
        fused(grads, found_inf, inv_scale)
        return
    for g in grads:
        found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(g)).any().to(found_inf.dtype)))
        g.mul_(inv_scale.to(g.dtype))


def batchnorm_base() -> type:
    """The common base class of `nn.BatchNorm1d/2d/3d` and `nn.SyncBatchNorm`
    (`nn.modules.batchnorm._BatchNorm`).

    Checked on 2.13.0. Fallback: `BatchNorm1d`'s direct base, the same class under
    whatever name a release gives it."""
    return getattr(nn.modules.batchnorm, "_BatchNorm", None) or nn.BatchNorm1d.__mro__[1]


def _checkpoint_wrapper_module():
    try:
        from torch.distributed.algorithms._checkpoint import checkpoint_wrapper
    except ImportError as e:
        raise ImportError(
            f"torch {torch.__version__} has no activation-checkpoint wrapper where "
            f"disttrain looks for it (checked on {', '.join(CHECKED_ON)}); "
            f"turn activation_checkpointing off"
        ) from e
    return checkpoint_wrapper


def checkpoint_wrap(module: nn.Module) -> nn.Module:
    """`module` wrapped for non-reentrant activation checkpointing (recomputed in
    backward), with `_checkpoint_wrapped_module` inserted in its parameter names
    (`torch.distributed.algorithms._checkpoint.checkpoint_wrapper`).

    Checked on 2.13.0. No fallback: a release without it raises ImportError that
    names the switch to turn off."""
    wrapper = _checkpoint_wrapper_module()
    return wrapper.checkpoint_wrapper(module, checkpoint_impl=wrapper.CheckpointImpl.NO_REENTRANT)


def checkpoint_wrapper_class() -> type:
    """The class `checkpoint_wrap` returns (FSDP1's wrap policy names it). Checked on
    2.13.0; no fallback, as `checkpoint_wrap`."""
    return _checkpoint_wrapper_module().CheckpointWrapper


def flatten_state_dict(state: dict) -> dict:
    """`state` flattened the way DCP keys it (`"model.layer.weight"`), leaves unchanged
    (`torch.distributed.checkpoint._nested_dict.flatten_state_dict`).

    Checked on 2.13.0. Fallback: nested mappings joined with "." (DCP's rule for dicts;
    lists stay leaves)."""
    try:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict as dcp_flatten
    except ImportError:
        return _flatten(state, "")
    return dcp_flatten(state)[0]


def flatten_with_paths(state: dict) -> tuple[dict, dict]:
    """`flatten_state_dict`'s flat dict and, for each key, its path (keys and list
    indices) inside `state`: where DCP's loader puts a loaded value back.

    Checked on 2.13.0. Fallback: the fallback's flat dict and each key's path of
    mapping keys (lists stay leaves)."""
    try:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict as dcp_flatten
    except ImportError:
        return _flatten(state, ""), _key_paths(state, ())
    return dcp_flatten(state)


def _key_paths(tree: Any, path: tuple) -> dict:
    if not isinstance(tree, dict):
        return {".".join(map(str, path)): path}
    out: dict = {}
    for key, value in tree.items():
        out.update(_key_paths(value, path + (key,)))
    return out


def _flatten(tree: Any, prefix: str) -> dict:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def load_is_copy(module: nn.Module) -> bool:
    """True when `module.load_state_dict(sd)` only copies each tensor of `sd` into the
    parameter or buffer of its name: torch's own `load_state_dict` and
    `_load_from_state_dict` on every submodule, no load hooks, no `set_extra_state`,
    and swapping on conversion off. Then a load whose values already sit in those
    tensors changes nothing by calling it.

    Checked on 2.13.0. Fallback (a release without these names): False, so the
    caller loads through torch as before."""
    try:
        if torch.__future__.get_swap_module_params_on_conversion():
            return False
        for m in module.modules():
            cls = type(m)
            if (
                cls.load_state_dict is not nn.Module.load_state_dict
                or "load_state_dict" in vars(m)
                or cls._load_from_state_dict is not nn.Module._load_from_state_dict
                or cls.set_extra_state is not nn.Module.set_extra_state
                or m._load_state_dict_pre_hooks
                or m._load_state_dict_post_hooks
            ):
                return False
    except AttributeError:
        return False
    return True


def load_keys(keys: set[str], storage_reader: Any) -> dict:
    """The nested state dict of just `keys` (DCP's flattened names) from a DCP
    checkpoint read by `storage_reader`, without a process group
    (`torch.distributed.checkpoint.state_dict_loader._load_state_dict_from_keys`).

    Checked on 2.13.0. No fallback: a release without it raises ImportError naming
    the release (exports need it; training does not)."""
    try:
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    except ImportError as e:
        raise ImportError(
            f"torch {torch.__version__} cannot read single keys of a checkpoint (checked on {', '.join(CHECKED_ON)})"
        ) from e
    return _load_state_dict_from_keys(keys, storage_reader=storage_reader)


def dcp_metadata_private_globals() -> dict[tuple[str, str], Any]:
    """The private globals a pickled DCP `.metadata` names, (module, name) -> object:
    `filesystem._StorageInfo`, `metadata._MEM_FORMAT_ENCODING` (of DCP), `serialization.
    _get_layout`, `pathlib._local.PosixPath` (Python 3.13+). Each only builds a value.
    Checked on 2.13.0 and 2.11.0. Fallback: a name a release lacks is left out (refused)."""
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    places = ((filesystem, "_StorageInfo"), (metadata, "_MEM_FORMAT_ENCODING"), (torch.serialization, "_get_layout"))
    found = {(module.__name__, name): getattr(module, name) for module, name in places if hasattr(module, name)}
    return {**found, ("pathlib._local", "PosixPath"): pathlib.PosixPath}


def fsdp1_unsharded_shapes(model: nn.Module) -> dict[int, tuple[int, ...]]:
    """id(original parameter) -> unsharded shape, for parameters that FSDP1
    (`use_orig_params=True`) turned into views of this rank's flat shard, read from
    each flat parameter's metadata (`module._handle.flat_param._param_infos`,
    `._shapes`, `._shared_param_infos`): no collective, no gathered copy.

    Checked on 2.13.0. Fallback (the metadata is gone): the parameters missing from
    the result, so callers see this rank's local shapes."""
    shapes: dict[int, tuple[int, ...]] = {}
    for module in model.modules():
        flat = getattr(getattr(module, "_handle", None), "flat_param", None)
        if flat is None or not hasattr(flat, "_param_infos"):
            continue
        for info, shape in zip(flat._param_infos, flat._shapes, strict=False):
            param = getattr(info.module, info.param_name, None)
            if param is not None:
                shapes[id(param)] = tuple(shape)
        for info in getattr(flat, "_shared_param_infos", ()):
            param = getattr(info.module, info.param_name, None)
            prim = getattr(info.prim_module, info.prim_param_name, None)
            if param is not None and id(prim) in shapes:
                shapes[id(param)] = shapes[id(prim)]
    return shapes


def set_last_lr(scheduler: Any, lrs: list[float]) -> None:
    """Make `scheduler.get_last_lr()` return `lrs` after the caller changed the groups'
    learning rates by hand (LRScheduler's `_last_lr`).

    Checked on 2.13.0. Fallback: the same attribute set anyway; a release that reads
    another one reports the rates of the last `step()` until the next step."""
    scheduler._last_lr = list(lrs)


def torchrun_flags() -> set[str]:
    """Every option string torchrun's parser accepts (`--nproc-per-node`, ...), read
    from argparse's `_option_string_actions`.

    Checked on 2.13.0 with CPython 3.11. Fallback: the option strings that the public
    `format_help()` text shows."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    actions = getattr(parser, "_option_string_actions", None)
    if actions is not None:
        return set(actions)
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", parser.format_help()))


def quick_rendezvous_event_names() -> None:
    """Have torchrun's dynamic rendezvous name its events (`Handler.method`, for its
    event log) from the calling frame, instead of calling `inspect.stack()` twice per
    event: that reads the source lines of every frame and searches `sys.modules` for
    each frame's module, about 0.15 s of the launcher's CPU per launch on 2 cores (9
    events), more with every restart. The names are the same. Call it in the launcher's
    process before torchrun runs; idempotent.

    Checked on 2.13.0 (`dynamic_rendezvous.get_method_name(depth=2)`, called by each
    `_record`) with CPython 3.11 (`sys._getframe`). Fallback: a release without that
    function keeps its own way (nothing is replaced)."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    except ImportError:
        return
    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = _method_name


def _method_name(depth: int = 2) -> str:
    """The name of the function `depth` frames above this one, as
    `inspect.stack()[depth].function` would give it; "no_method_name" past the stack's top."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def forget_sharding_plans() -> None:
    """Forget the DTensor sharding plans torch cached in this process (its Python and C++
    caches of each operator's plan, and redistribution's). torch keys a plan by the
    operator and its arguments' specs, whose DeviceMesh compares by the ranks and layout
    it spans, not by this process's place in it, and hands back the output specs it
    cached, with the mesh first seen and that mesh's coordinate. A process that joins an
    equal mesh at another rank would place its shards at the old rank's coordinate
    (checkpoints whose chunks overlap). Nothing to forget when DTensor was never imported
    (and importing it costs start-up).

    Checked on 2.13.0 (`torch.distributed.tensor.debug._clear_sharding_prop_cache`,
    `_redistribute._gen_transform_infos`). Fallback: the two caches it clears, each where
    the release has it; a `RuntimeError` when it has neither, since a process that kept
    its plans would shard at its old place (a fast recovery then takes torchrun's
    restart path)."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import _redistribute, debug

    clear_all = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear_all is not None:
        clear_all()
    else:
        from torch.distributed.tensor import DTensor

        dispatcher = getattr(DTensor, "_op_dispatcher", None)
        python_cache = getattr(getattr(dispatcher, "sharding_propagator", None), "propagate_op_sharding", None)
        python_clear = getattr(python_cache, "cache_clear", None)
        native_clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
        if python_clear is None or native_clear is None:
            raise RuntimeError(
                f"torch {torch.__version__} has no way to clear DTensor's sharding caches that disttrain knows; "
                "a process that moved rank would keep its old shards' places"
            )
        python_clear()
        native_clear()
    clear = getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None)
    if clear is not None:
        clear()


def import_dynamo() -> None:
    """Import `torch._dynamo` now (DistributedDataParallel's first construction reads
    its config: about 3 s), so a later step does not pay for it.

    Checked on 2.13.0. Fallback: nothing (a release without it has nothing to warm)."""
    try:
        import torch._dynamo  # noqa: F401
    except ImportError:
        pass


def finish_interpreter() -> None:
    """What the interpreter does at a normal exit before finalizing: join non-daemon
    threads (`threading._shutdown`), then run the atexit functions
    (`atexit._run_exitfuncs`); for a forked child that leaves with `os._exit`.

    Checked on CPython 3.11. Fallback: a step whose function is missing is
    skipped (threads are then abandoned, or atexit functions not run)."""
    import atexit
    import threading

    steps: list[Callable[[], Any] | None] = [
        getattr(threading, "_shutdown", None),
        getattr(atexit, "_run_exitfuncs", None),
    ]
    for step in steps:
        if step is not None:
            step()


# ---------------------------------------------------------------- wrappers: one way to see through them

WRAPPER_PARTS = {
    "compile": "_orig_mod",
    "ddp": "module",
    "dp": "module",
    "fsdp1": "_fsdp_wrapped_module",
    "checkpoint": "_checkpoint_wrapped_module",
}
"""Each wrapper kind -> the attribute that holds the module it wraps. That attribute is a
registered submodule, so it is also the part the wrapper inserts into every parameter
and state-dict name below it (`_orig_mod.`, `module.`, ...). Checked on 2.13.0; a
release that renames one is seen as no wrapper (`wrapper_kind` None), its part stays in
the names, and a comparison of names then reports a mismatch, never silent damage."""

_INSIDE_ONLY = frozenset(WRAPPER_PARTS.values()) - {"module"}
"""Parts no user attribute can be mistaken for: removed wherever they stand in a name."""


def wrapper_kind(module: nn.Module) -> str | None:
    """'compile' (`torch.compile(model)`'s `OptimizedModule`), 'ddp', 'dp'
    (`nn.DataParallel`), 'fsdp1' (`FullyShardedDataParallel`), 'checkpoint' (the
    activation-checkpoint wrapper), or None for any other module (FSDP2's `fully_shard`
    included: it changes the module's class in place and wraps nothing).

    Classes whose module was never imported are not looked up (dynamo, FSDP and the
    checkpoint wrapper cost up to a second to import): no model can be one of them.
    `OptimizedModule` is compared by name for the same reason. Checked on 2.13.0;
    fallback: a class a release moved is not recognised (None)."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return "ddp"
    if isinstance(module, DataParallel):
        return "dp"
    if type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module):
        return "compile"
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and isinstance(module, fsdp.FullyShardedDataParallel):
        return "fsdp1"
    ckpt = sys.modules.get("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
    if ckpt is not None and isinstance(module, getattr(ckpt, "ActivationWrapper", ())):
        return "checkpoint"
    return None


def inner_module(module: nn.Module) -> nn.Module | None:
    """The module one wrapper holds (`WRAPPER_PARTS`), or None when `module` is no
    wrapper (`wrapper_kind` None). Peels one layer only; `unwrap` peels all.

    Checked on 2.13.0 (each kind holds its module as the submodule `WRAPPER_PARTS`
    names). Fallback: as `wrapper_kind`'s (a wrapper not recognised gives None)."""
    kind = wrapper_kind(module)
    return None if kind is None else getattr(module, WRAPPER_PARTS[kind])


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside every wrapper around `model` (`dt.unwrap`):
    `torch.compile`, DDP, DataParallel, FSDP1 and the activation-checkpoint wrapper, in
    any nesting (`torch.compile(DDP(model))` gives `model`).

    Use it to reach the model's own methods and attributes after `dt.wrap` or
    `job.wrap` (a `configure_optimizers`, a config, `generate`); train and step the
    wrapped module, not this one, or the gradients are not synchronised. A module that
    is no wrapper (a plain model, or FSDP2's, sharded in place) is returned as is.
    Wrappers inside the model (FSDP1 units, checkpoint-wrapped blocks) stay: they are
    part of the module that trains; `canonical_name` removes their parts from names.
    Not a collective; never raises. Checked on 2.13.0. Fallback: as `wrapper_kind`'s (a
    wrapper not recognised is returned as the user's module)."""
    inner = inner_module(model)
    while inner is not None:
        model, inner = inner, inner_module(inner)
    return model


def canonical_name(name: str) -> str:
    """A parameter, buffer or state-dict name as the plain model names it: every
    wrapper's part removed. `_orig_mod`, `_fsdp_wrapped_module` and
    `_checkpoint_wrapped_module` go wherever they stand (FSDP1 units and checkpointed
    blocks sit deep in the model); `module` goes only in the leading run of wrapper
    parts (`module.`, `_orig_mod.module.`), where DDP and DataParallel put it, so a
    user's own submodule named `module` deeper in the model keeps its name.

    A string cannot tell a plain model's own top-level `module` attribute from DDP's:
    both lose it. Callers compare canonical names on both sides (the wrapped model's
    and the plain model's), where that is consistent, or map them back to the target
    model's own keys (`checkpoint.files.load_model`). Idempotent; never raises.

    Checked on 2.13.0 (`WRAPPER_PARTS`). Fallback: a part a release renames stays in the
    name, so names compare unequal instead of matching the wrong tensor."""
    parts = name.split(".")
    lead = 0
    while lead < len(parts) - 1 and parts[lead] in WRAPPER_PARTS.values():
        lead += 1
    return ".".join(p for p in parts[lead:] if p not in _INSIDE_ONLY)


def abort_process_groups() -> bool:
    """Abort the NCCL communicators of every running group, so that a survivor blocked
    in a collective on a dead peer returns at once (an in-memory recovery). Checked on
    2.13.0: `distributed_c10d._abort_process_group(None)` aborts all groups (NCCL only;
    it wants TORCH_NCCL_ASYNC_ERROR_HANDLING=0, which `elastic.fast_recovery` sets).
    Fallback on a release without it: the public `ProcessGroup.abort()` of the default
    group when it exists; else False (the collective waits out its timeout)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    try:
        abort_all = getattr(c10d, "_abort_process_group", None)
        if abort_all is not None:
            abort_all(None)
            return True
        abort = getattr(dist.group.WORLD, "abort", None)
        if callable(abort):
            abort()
            return True
    except (RuntimeError, ValueError, AssertionError):  # a group already gone, or not NCCL
        return False
    return False


def collectives_issued() -> int | None:
    """How many collectives this rank has issued on the default group (DDP's gradient
    all-reduces included), or None when no group is up or the release cannot tell.
    Checked on 2.13.0 (gloo and NCCL count every collective):
    `ProcessGroup._get_sequence_number_for_group()`. Read from another thread; the
    hang watchdog of a plain script uses it as its progress counter. Fallback on a
    release without it: None, and that watchdog watches the heartbeats only."""
    import torch.distributed as dist

    try:
        if not dist.is_initialized():
            return None
        count = getattr(dist.group.WORLD, "_get_sequence_number_for_group", None)
        return int(count()) if callable(count) else None
    except (RuntimeError, ValueError):
        return None


def loss_parallel_active() -> bool:
    """Whether torch's `loss_parallel()` context is entered in this process: its cross
    entropy handlers are in DTensor's dispatcher (`DTensor._op_dispatcher.
    _custom_op_handlers` holds `aten._log_softmax`). Checked on 2.13.0. Entering the
    context twice and leaving it twice fails (the second exit finds nothing to remove),
    so disttrain enters it only when this is False. Fallback on a release without the
    attribute: False (disttrain then always enters it itself)."""
    from torch.distributed.tensor import DTensor

    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    return isinstance(handlers, dict) and torch.ops.aten._log_softmax.default in handlers


def set_plan_cache_key(planner: Any, key: str) -> None:
    """Keep a DCP save planner's cached plans under `key` instead of its class name.
    Checked on 2.13.0: `DefaultSavePlanner(enable_plan_caching=True)` caches in
    class-level dicts under `_cached_plans_key`. Fallback on a release without that
    attribute: caching off (`_enable_plan_caching`), so plans are always exchanged."""
    if hasattr(planner, "_cached_plans_key"):
        planner._cached_plans_key = key
    else:
        planner._enable_plan_caching = False


def stager_is_spent(stager: Any) -> bool:
    """Whether a DCP `DefaultStager` can stage no more. torch 2.11's closes its inner
    state-dict stager after each stage (the copy dispatch table emptied, so a second
    stage raises `KeyError: <class 'type'>`); later releases keep it for reuse.
    Checked on 2.11.0 and 2.13.0. Fallback on a release without those attributes: not
    spent (the stager is reused, as those releases allow)."""
    inner = getattr(stager, "_state_dict_stager", None)
    return inner is not None and not getattr(inner, "_deepcopy_dispatch", True)


def cuda_fork_poisoned() -> bool:
    """In a forked child: whether its parent had touched the CUDA driver, so that CUDA
    cannot start here ("Cannot re-initialize CUDA in forked subprocess"). Not only an
    initialised context does that: `torch.cuda.is_available()` and `device_count()` count
    devices through the driver, which poisons every later fork, and a library imported
    by the parent may have called them. Checked on 2.11.0 and 2.13.0. Fallback on a
    release without `_is_in_bad_fork`: not poisoned (CUDA then fails in the worker with
    torch's own message)."""
    is_in_bad_fork = getattr(torch.cuda, "_is_in_bad_fork", None)
    return bool(is_in_bad_fork()) if is_in_bad_fork is not None else False


_BUILT_HOOKS: list[Callable[[Any], None]] = []


def on_optimizer_built(hook: Callable[[Any], None]) -> None:
    """From now on, call `hook(optimizer)` in this process at the end of every
    `torch.optim.Optimizer.__init__` (a hook given twice is called once).

    torch has global hooks for an optimizer's step (`register_optimizer_step_pre_hook`)
    but none for its construction, so the first call wraps `Optimizer.__init__`, which
    every torch optimizer calls (ZeroRedundancyOptimizer and the subclasses of other
    libraries included). Checked on 2.13.0. No fallback is needed while
    `Optimizer.__init__` exists; an optimizer whose class never calls it, or one copied
    or unpickled, is not seen, and the caller treats "not seen" as "built before"."""
    if hook in _BUILT_HOOKS:
        return
    _BUILT_HOOKS.append(hook)
    if len(_BUILT_HOOKS) > 1:
        return
    original = torch.optim.Optimizer.__init__

    def init_then_hooks(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for each in _BUILT_HOOKS:
            each(self)

    setattr(init_then_hooks, "__wrapped__", original)  # noqa: B010  (what functools.wraps would set)
    setattr(torch.optim.Optimizer, "__init__", init_then_hooks)  # noqa: B010  (mypy refuses a method assigned)


PythonUnpickler: TypeAlias = pickle._Unpickler
"""pickle's pure-Python unpickler class: its `dispatch` table of opcodes is what a
restricted unpickler checks before each opcode runs (`checkpoint.metadata_pickle`);
the C unpickler has no such table. A private name of the standard library, kept here
with torch's."""


@contextlib.contextmanager
def exit_barrier_of(agents_gone: Callable[[int], int]) -> Iterator[None]:
    """Within the block, a torchrun agent of this process whose workers are done waits at
    its exit barrier for the agents still in the job only: `group_world_size` less
    `agents_gone(local_world_size)` (asked when the barrier starts). The barrier counts
    arrivals up to the rendezvous' agent count, so an agent lost with its node would
    keep every survivor there for `exit_barrier_timeout` (300 s), which `torch.distributed.run`
    does not let a launcher set. Counting fewer than are left only ends the wait early.

    Wraps `SimpleElasticAgent._exit_barrier` (and reads its `_worker_group`). Checked on
    2.13.0. Fallback (no such method): nothing is wrapped and the wait stays torch's."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    original = getattr(SimpleElasticAgent, "_exit_barrier", None)
    if original is None:
        yield
        return

    def survivors_only(agent: Any) -> None:
        group = agent._worker_group
        gone = agents_gone(group.spec.local_world_size)
        if gone > 0:
            group.group_world_size = max(1, group.group_world_size - gone)
        original(agent)

    setattr(SimpleElasticAgent, "_exit_barrier", survivors_only)  # noqa: B010  (mypy refuses a method assigned)
    try:
        yield
    finally:
        setattr(SimpleElasticAgent, "_exit_barrier", original)  # noqa: B010


@contextlib.contextmanager
def waiting_nodes_through_outages(on_change: Callable[[BaseException | None], None]) -> Iterator[None]:
    """Within the block, torchrun's poll for nodes waiting to join (the agent asks
    `num_nodes_waiting` each monitor interval while its workers are healthy) answers 0
    while the rendezvous backend cannot be reached, instead of ending the agent and its
    healthy workers: an etcd restarted under a running job costs nothing until the
    membership changes. `on_change(error)` is called when the backend first fails and
    `on_change(None)` when it answers again; a failure of anything but the connection
    (a corrupt state) still ends the agent, as does any failure of a later rendezvous.

    Wraps `DynamicRendezvousHandler.num_nodes_waiting` (c10d, etcd-v2). Checked on 2.13.0.
    Fallback (no such method): nothing is wrapped and an outage ends the agent, as in torch."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    original = getattr(DynamicRendezvousHandler, "num_nodes_waiting", None)
    if original is None:
        yield
        return
    down = [False]

    def answered_or_zero(handler: Any) -> int:
        try:
            count = original(handler)
        except RendezvousConnectionError as e:
            if not down[0]:
                down[0] = True
                on_change(e)
            return 0
        if down[0]:
            down[0] = False
            on_change(None)
        return count

    setattr(DynamicRendezvousHandler, "num_nodes_waiting", answered_or_zero)  # noqa: B010
    try:
        yield
    finally:
        setattr(DynamicRendezvousHandler, "num_nodes_waiting", original)  # noqa: B010
