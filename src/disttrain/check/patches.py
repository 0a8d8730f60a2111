"""Public functions and methods replaced for the check window (`torch.save`,
`GradScaler.step`, `print`, ...), each by a wrapper that calls the original with the
same arguments and returns what it returns: the checks only look.

Why a record of its own: another part may wrap the same name after us (a second check,
the user's own monkeypatch). `restore` puts an original back only where our wrapper is
still the one in place; where it is not, ours stays in the chain, and each wrapper
passes straight through once its watch is no longer active.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


class Patches:
    """`wrap(owner, name, make)`: `owner.name = make(original)`; `restore()`: undone."""

    def __init__(self) -> None:
        self._done: list[tuple[Any, str, Any, Any]] = []

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Replace `owner.name` (a module's function or a class's method) by
        `make(original)`; nothing when `owner` has no such attribute."""
        original = getattr(owner, name, None)
        if original is None:
            return
        wrapper = make(original)
        # the original's name, signature and `__wrapped__`: another check that wraps
        # this wrapper binds arguments by the real signature (inspect.signature follows it)
        functools.update_wrapper(wrapper, original)
        setattr(owner, name, wrapper)
        self._done.append((owner, name, original, wrapper))

    def restore(self) -> None:
        """Every original back where our wrapper is still in place, newest first."""
        for owner, name, original, wrapper in reversed(self._done):
            if getattr(owner, name, None) is wrapper:
                setattr(owner, name, original)
        self._done = []
