"""Checkpoints written with `torch.save` by the user's code (a save torch or disttrain
make on their own behalf, DCP's shards included, is not counted), seen by wrapping
`torch.save`:

- **several ranks writing one file**: the same path (resolved: symlinks, `..`) saved
  by two ranks on one host during the window. Two writers of one file can leave it torn
  or mixed, and the ranks race to it even when each writes the same bytes -- a stop.
  Ranks on different hosts writing the same path are not compared (their folders may
  be each node's own disk: saving on each node's local rank 0 is a pattern).
- **a wrapper's `module.` keys**: a state_dict (the object saved, or one value of a
  dict saved) whose every key starts with `module.` -- the state_dict of a
  DistributedDataParallel (or DataParallel) wrapper. It loads into the plain model only
  after the prefix is stripped -- a warning.

The path is taken from a str or `os.PathLike`, or a file object's `name`; a save to a
buffer (`io.BytesIO`) has no path and is not compared.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

import torch

from disttrain.check.patches import Patches
from disttrain.check.verdicts import Finding, called_by_user, user_line


def target(f: Any) -> str | None:
    """The path a `torch.save(obj, f)` writes, as the user gave it; None for a buffer."""
    if isinstance(f, (str, os.PathLike)):
        path = os.fspath(f)
        return path if isinstance(path, str) else None
    name = getattr(f, "name", None)
    return name if isinstance(name, str) else None


def prefixed(obj: Any) -> bool:
    """Whether `obj`, or one value of it when it is a dict, is a state_dict whose every
    key starts with `module.` (tensors under string keys)."""
    candidates = [obj, *(obj.values() if isinstance(obj, Mapping) else [])]
    return any(_wrapper_state(c) for c in candidates)


def _wrapper_state(obj: Any) -> bool:
    if not isinstance(obj, Mapping) or not obj:
        return False
    keys, values = list(obj.keys()), list(obj.values())
    return all(isinstance(k, str) and k.startswith("module.") for k in keys) and any(
        isinstance(v, torch.Tensor) for v in values
    )


class SaveWatch:
    """This rank's `torch.save` calls since the last exchange (`take`), and the writers
    of each file over the whole window (`judge`, the same on every rank)."""

    def __init__(self) -> None:
        self.saved: list[dict] = []
        self.writers: dict[tuple[str, str], dict[int, tuple[str, str | None]]] = {}
        """(host, resolved path) -> {rank: (the path as given, the line)}: every rank keeps the same."""
        self.active = False
        self._patches = Patches()

    def install(self) -> None:
        self.active = True
        self._patches.wrap(torch, "save", self._save)

    def remove(self) -> None:
        self.active = False
        self._patches.restore()

    def _save(self, original: Any) -> Any:
        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if self.active and called_by_user():
                self._record(obj, f)
            return original(obj, f, *args, **kwargs)

        return save

    def _record(self, obj: Any, f: Any) -> None:
        path = target(f)
        if path is not None and len(self.saved) < 64:
            self.saved.append(
                {
                    "path": path,
                    "resolved": os.path.realpath(path),
                    "host": socket.gethostname(),
                    "line": user_line(),
                    "prefixed": prefixed(obj),
                }
            )

    def pending(self) -> bool:
        return bool(self.saved)

    def take(self) -> list[dict]:
        taken, self.saved = self.saved, []
        return taken

    def judge(self, rows: list[list[dict]]) -> list[tuple[str, Finding]]:
        """Every rank's `take()` at the same exchange: a stop for a file two ranks
        wrote in the window, a warning for `module.`-prefixed keys (see the module)."""
        found = []
        for rank, saves in enumerate(rows):
            for s in saves:
                writers = self.writers.setdefault((s["host"], s["resolved"]), {})
                writers.setdefault(rank, (s["path"], s["line"]))
                if len(writers) > 1:
                    found.append(("saves-shared", Finding("saves", True, _shared_text(writers))))
                if s["prefixed"]:
                    found.append(("saves-prefix", Finding("saves", False, _prefix_text(rank, s))))
        return found


def _shared_text(writers: dict[int, tuple[str, str | None]]) -> str:
    ranks = sorted(writers)
    path = writers[ranks[0]][0]
    lines = {writers[r][1] for r in ranks}
    if len(lines) == 1:
        where = f" at {lines.pop()}" if None not in lines else ""
    else:
        where = " (" + ", ".join(f"rank {r} at {writers[r][1]}" for r in ranks) + ")"
    return (
        f"ranks {', '.join(map(str, ranks))} each wrote the file {path} with torch.save"
        f"{where}: several ranks writing one file race, and the "
        "file can be left torn or mixed from different ranks' bytes. Fix: save on one rank "
        "only (`if dist.get_rank() == 0: torch.save(...)`, then `dist.barrier()` before any "
        "rank reads it), or save a sharded state with torch.distributed.checkpoint (dcp.save: "
        "each rank writes its own part)."
    )


def _prefix_text(rank: int, save: dict) -> str:
    line = save["line"]
    return (
        f"the state_dict saved to {save['path']}{f' at {line}' if line else ''} (rank {rank}) "
        "has every key starting with `module.`: it is the DistributedDataParallel wrapper's "
        "state_dict, which the plain model (without DDP, for inference or a resume at another "
        "size) loads only after stripping the prefix (`Unexpected key(s)` otherwise). Fix: "
        "save the wrapped model's own state, `model.module.state_dict()`; for files already "
        "saved, torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, 'module.') "
        "before load_state_dict."
    )
