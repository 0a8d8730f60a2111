"""The part of the state an async save copies: what this rank writes, not all of it.

DCP's `async_save` copies the whole state dict to CPU memory before it plans, and
its planner then gives each replicated tensor to one rank: under DDP every rank
copied every tensor and wrote 1/world of them. After one save, this rank's final
plan says which tensors it writes. While the state keeps that layout (the same
flattened keys, shapes and dtypes), the next async save hands DCP only those tensors
and every non-tensor value: the ranks' parts are disjoint and together whole, so the
plan, the metadata and the files are those of a save of the whole state, for
1/world of the copy.
"""

from __future__ import annotations

from typing import Any

import torch

from disttrain.runtime import torch_compat


def layout_of(tensors: dict) -> tuple:
    """The layout of a state dict: each flattened key with its shape and dtype
    (tensors) or its type (values), in order."""
    flat = torch_compat.flatten_state_dict(tensors)
    return tuple(
        (k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, type(v).__name__) for k, v in flat.items()
    )


def written_paths(planner) -> list[tuple]:
    """The nested paths (DCP's flattening mappings) of the tensors this rank's final
    plan wrote and of every non-tensor value, from a save planner after its save."""
    tensors = {
        item.index.fqn
        for item in planner.plan.items
        if isinstance(planner.state_dict.get(item.index.fqn), torch.Tensor)
    }
    return [
        planner.mappings[fqn]
        for fqn, value in planner.state_dict.items()
        if fqn in tensors or not isinstance(value, torch.Tensor)
    ]


def _get(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def part_of(tensors: dict, paths: list[tuple]) -> dict:
    """The nested state dict of just the entries at `paths` of `tensors` (the values
    themselves, not copies)."""
    from disttrain.checkpoint.json_records import set_path  # imports DCP: not at start-up

    part: dict = {}
    for path in paths:
        set_path(part, tuple(path), _get(tensors, path))
    return part


class AsyncStaging:
    """One checkpointer's async staging: DCP's stager, kept across saves so that each
    copies into the CPU buffers of the previous one (at most one save is in flight),
    not into fresh memory; and the part of the state each save copies."""

    def __init__(self):
        self._stager = None
        self._layout: tuple | None = None
        self._paths: list[tuple] | None = None  # this rank's part of a save of `_layout`
        self._whole = False  # the stager holds buffers for the whole state

    def stager(self):
        if self._stager is not None and torch_compat.stager_is_spent(self._stager):
            self.close()  # torch 2.11: a stager copies once, so each save takes a new one
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=torch.cuda.is_available(),
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )
        return self._stager

    def part(self, tensors: dict) -> dict:
        """What the next async save copies: this rank's part while the layout is that of
        the save `learn` saw, else all of `tensors`. The first part starts a fresh
        stager, so the whole state's buffers are freed."""
        layout = layout_of(tensors)
        if layout != self._layout or self._paths is None:
            self._layout, self._paths, self._whole = layout, None, True
            return tensors
        if self._whole:
            self.close()
            self._whole = False
        return part_of(tensors, self._paths)

    def learn(self, planner) -> None:
        """After a save of the whole state succeeded: remember this rank's part."""
        if self._paths is None:
            self._paths = written_paths(planner)

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None
