"""A resume that gives every rank the same random state: each rank seeded its own
generator (dropout, augmentation and noise differ across ranks), then a restore from a
checkpoint set one state on all of them -- every rank loaded one rank's RNG file.

Seen by wrapping the public setters the user's code calls: `torch.set_rng_state`
(also reached as `torch.random.set_rng_state`), `torch.cuda.set_rng_state`,
`random.setstate` and `numpy.random.set_state`. For each generator, the first restore
since the last exchange keeps a digest of the state it replaced and of the state it
set. The verdict (`judge`), on every rank's digests: the replaced states differed
across ranks (the script seeds per rank) and the set states are identical -- a
warning (the run goes on, but it is not the run that was saved: every rank now draws
rank 0's numbers).

Not seen: a `torch.Generator` of the script's own (`generator.set_state` is a method
of a C type, which cannot be wrapped), a restore whose states differ but come from the
wrong ranks (rank 1 loading rank 2's file), and a sampler's position restored from
another rank (samplers have no common state API).
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import random
import sys
from collections.abc import Callable
from typing import Any

import torch

from disttrain.check.patches import Patches
from disttrain.check.verdicts import Finding, called_by_user, user_line


def digest(state: Any) -> str:
    """A short digest of a generator's state (a byte tensor, or Python/numpy values)."""
    if isinstance(state, torch.Tensor):
        data = state.detach().cpu().contiguous().numpy().tobytes()
    else:
        data = pickle.dumps(state)
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _setters() -> list[tuple[Any, str, str, Callable[[], Any]]]:
    """(owner, setter's name, the name in messages, the getter of the state it replaces)."""
    found: list[tuple[Any, str, str, Callable[[], Any]]] = [
        (torch, "set_rng_state", "torch.set_rng_state", torch.get_rng_state),
        (torch.random, "set_rng_state", "torch.set_rng_state", torch.get_rng_state),
        (torch.cuda, "set_rng_state", "torch.cuda.set_rng_state", torch.cuda.get_rng_state),
        (random, "setstate", "random.setstate", random.getstate),
    ]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        found.append((numpy.random, "set_state", "numpy.random.set_state", numpy.random.get_state))
    return found


class RngWatch:
    """This rank's restores since the last exchange: {generator: (replaced, set, line)}."""

    def __init__(self) -> None:
        self.restored: dict[str, tuple[str, str, str | None]] = {}
        self.active = False
        self._patches = Patches()

    def install(self) -> None:
        self.active = True
        for owner, name, shown, getter in _setters():
            self._patches.wrap(owner, name, functools.partial(self._wrapper, shown=shown, getter=getter))

    def remove(self) -> None:
        self.active = False
        self._patches.restore()

    def _wrapper(self, original: Any, shown: str, getter: Callable[[], Any]) -> Any:
        def set_state(*args: Any, **kwargs: Any) -> Any:
            state = args[0] if args else kwargs.get("new_state", kwargs.get("state"))
            if not (self.active and shown not in self.restored and called_by_user()):
                return original(*args, **kwargs)
            try:
                replaced = digest(getter())
            except Exception:  # noqa: BLE001  (a generator the getter cannot read: not compared)
                return original(*args, **kwargs)
            result = original(*args, **kwargs)
            self.restored[shown] = (replaced, digest(state), user_line())
            return result

        return set_state

    def pending(self) -> bool:
        return bool(self.restored)

    def take(self) -> dict[str, tuple[str, str, str | None]]:
        taken, self.restored = self.restored, {}
        return taken


def judge(rows: list[dict[str, Any]]) -> list[tuple[str, Finding]]:
    """Every rank's `take()`: a warning for a generator whose replaced states differed
    across ranks and whose restored state is the same on all (see the module)."""
    if len(rows) < 2:
        return []
    for shown in sorted(rows[0]):
        if not all(shown in r for r in rows):
            continue
        replaced = {r[shown][0] for r in rows}
        restored = {r[shown][1] for r in rows}
        if len(replaced) > 1 and len(restored) == 1:
            return [("rng", Finding("rng", False, _same_text(shown, len(rows), rows[0][shown][2])))]
    return []


def _same_text(shown: str, world: int, line: str | None) -> str:
    return (
        f"the random state restored with {shown}{f' at {line}' if line else ''} is the same on "
        f"all {world} ranks, though each rank had its own before the restore (a seed per rank): "
        "every rank loaded one rank's RNG state, so the resumed run is not the run that was "
        "saved, and every rank now draws the same dropout masks and augmentations. Fix: save "
        "each rank's state under its own name (f'rng_rank{rank}.pt') and have each rank load "
        "its own; or, after loading, reseed each rank (torch.manual_seed(seed + rank))."
    )
