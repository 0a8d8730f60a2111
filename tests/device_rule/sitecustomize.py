"""Loaded by every process of a test run that puts this folder on PYTHONPATH: wraps the
`torch.distributed` collectives so that each call checks its tensors' device against
the backends its group was started with (`dist.get_backend_config`), the rule NCCL
enforces on GPUs ("cuda:nccl" takes CUDA tensors only). A violation is written to
$DEVICE_RULE_LOG and raised; every checked call is counted there too."""

import functools
import json
import os


def _install() -> None:
    import torch
    import torch.distributed as dist

    log = os.environ["DEVICE_RULE_LOG"]

    def tensors_of(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from tensors_of(item)

    def accepted(group) -> set[str]:
        config = dist.get_backend_config(group)  # "gloo", or "cpu:gloo,cuda:nccl"
        if ":" not in config:
            return {"cpu", "cuda"} if config == "gloo" else {"cuda"}
        return {part.split(":")[0] for part in config.split(",")}

    def check(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            group = kwargs.get("group")
            devices = {t.device.type for t in tensors_of(list(args) + list(kwargs.values()))}
            allowed = accepted(group)
            record = {"call": name, "devices": sorted(devices), "allowed": sorted(allowed),
                      "pid": os.getpid()}
            with open(log, "a") as f:
                f.write(json.dumps(record) + "\n")
            if not devices <= allowed:
                raise RuntimeError(f"device rule: {name} got tensors on {sorted(devices)}, but its "
                                   f"group's backend ({dist.get_backend_config(group)}) takes {sorted(allowed)}")
            return fn(*args, **kwargs)
        return wrapper

    for name in ("all_reduce", "all_gather", "broadcast", "reduce", "all_gather_into_tensor",
                 "reduce_scatter_tensor", "all_to_all_single", "scatter", "gather"):
        setattr(dist, name, check(name, getattr(dist, name)))


if os.environ.get("DEVICE_RULE_LOG"):
    _install()
