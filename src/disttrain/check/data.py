"""The data each rank trains on, seen by wrapping `DataLoader.__iter__` (a public class
attribute): the iterator it returns is handed back inside a thin wrapper that passes
every batch through unchanged.

Per DataLoader, this rank keeps: how many epochs were started (`__iter__` calls), the
batches per epoch (`len(loader)`, when it has one), a fingerprint of the epoch's first
batch (the float64 sum and |sum| of its tensors), and whether its sampler's `epoch`
stood still between two epochs while it shuffles (`set_epoch` was not called). The
training loader is the one that yielded the newest batch before an optimizer step.

The ranks compare these at each checked step (`compare`):
- every rank's first batch identical: every rank trains on the same samples (no
  DistributedSampler) -- a stop;
- a different number of batches per epoch: the last steps of an epoch hang or go
  unmatched -- a warning;
- a shuffling sampler whose epoch did not move: the same order every epoch -- a warning.

Nothing here draws a random number or reads a sample the script did not ask for: a
sampler is never iterated by the checks (a RandomSampler would consume the script's
random state).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from disttrain.check import samples
from disttrain.check.verdicts import Finding, user_line

WIDTH = 6
"""Numbers per rank in `vector`: present, epochs, batches per epoch, fingerprint (2), order repeated."""


@dataclass
class LoaderState:
    epochs: int = 0
    length: int = -1
    first: tuple[float, float] | None = None
    sampler_epoch: Any = None
    repeated: bool = False
    line: str | None = None
    """The user's line that started the newest epoch (`for batch in loader`)."""
    head: list[float] | None = None
    """`samples.loader_head`: how the loader's sampler splits which dataset."""
    batches: int = 0
    """Batches the newest iterator yielded."""
    before: tuple[Any, bool] = (None, False)
    """`sampler_epoch` and `repeated` as they were before the newest iterator started."""


def fingerprint(batch: Any) -> tuple[float, float]:
    """(sum, sum of |x|) in float64 over every tensor in a batch (`samples.batch_tensors`:
    nested lists, tuples, dicts); other values, DTensors and meta tensors count as 0."""
    total, size = 0.0, 0.0
    with torch.no_grad():
        for item in samples.batch_tensors(batch):
            t = item.detach()
            total += float(t.sum(dtype=torch.float64))
            size += float(t.abs().sum(dtype=torch.float64))
    return total, size


def shuffling_sampler(loader: DataLoader) -> Any:
    """The loader's sampler that takes `set_epoch` and shuffles (a DistributedSampler),
    whether passed as `sampler=` or inside a `batch_sampler=`; None otherwise."""
    for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if hasattr(sampler, "set_epoch") and getattr(sampler, "shuffle", False):
            return sampler
    return None


class _Batches:
    """The loader's own iterator, every batch passed through unchanged."""

    def __init__(self, inner: Any, on_batch: Callable[[Any], None]) -> None:
        self._inner, self._on_batch = inner, on_batch

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        self._on_batch(batch)
        return batch

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class DataWatch:
    """This rank's view of its DataLoaders while the checks run."""

    def __init__(self) -> None:
        self.loaders: weakref.WeakKeyDictionary[DataLoader, LoaderState] = weakref.WeakKeyDictionary()
        self.current: LoaderState | None = None
        self.prints: list[torch.Tensor] = []
        """The training batches' sample prints since the last checked step."""
        self.seen = samples.SeenSamples()
        self.closed = self.paused = False
        """closed: the window is over, iterators still open pass batches through untouched;
        paused: only the first batch of each epoch is still fingerprinted."""
        self._original: Any = None

    def install(self) -> None:
        original = self._original = DataLoader.__iter__
        watch = self

        def __iter__(loader: DataLoader) -> Any:
            state = watch.started(loader)
            return _Batches(original(loader), lambda batch: watch.yielded(state, batch))

        DataLoader.__iter__ = __iter__  # type: ignore[method-assign]

    def remove(self) -> None:
        self.closed = True
        if self._original is not None:
            DataLoader.__iter__ = self._original  # type: ignore[method-assign]
            self._original = None

    def started(self, loader: DataLoader) -> LoaderState:
        """A new epoch of `loader`: read before its iterator (and sampler) starts."""
        state = self.loaders.setdefault(loader, LoaderState())
        if state.epochs > 0 and state.batches <= 1:
            # the iterator before yielded one batch at most: a peek (`next(iter(loader))`,
            # for the batch size, say), not an epoch
            state.epochs, (state.sampler_epoch, state.repeated) = state.epochs - 1, state.before
        sampler = shuffling_sampler(loader)
        epoch = getattr(sampler, "epoch", None) if sampler is not None else None
        state.before = (state.sampler_epoch, state.repeated)
        state.repeated = state.repeated or (state.epochs > 0 and epoch is not None and epoch == state.sampler_epoch)
        state.sampler_epoch = epoch
        state.epochs, state.first, state.batches = state.epochs + 1, None, 0
        self.prints = []  # samples of another epoch (or of a peek) are not this epoch's
        try:
            state.length = len(loader)
        except TypeError:  # an IterableDataset without a length
            state.length = -1
        state.line = user_line()
        state.head = samples.loader_head(loader)
        return state

    def yielded(self, state: LoaderState, batch: Any) -> None:
        if self.closed:
            return
        state.batches += 1
        if state.first is None:
            state.first = fingerprint(batch)
        if state is not self.current or self.paused:
            self.prints = []  # another loader (evaluation, say): the newest one trains
        self.current = state
        if not self.paused and sum(len(p) for p in self.prints) < samples.MAX_PER_STEP:
            self.prints.append(samples.sample_prints(batch)[: samples.MAX_PER_STEP])

    def vector(self) -> list[float]:
        """This rank's numbers for `compare` and `compare_samples`: `WIDTH` of them, then
        the loader's `samples.HEAD`, the count k of new sample prints and 2k numbers.
        The prints start over."""
        s = self.current
        if s is None or s.first is None:
            return [0.0] * WIDTH
        new = torch.cat(self.prints) if self.prints else torch.zeros(0, 2, dtype=torch.float64)
        self.prints = []
        head = s.head or [0.0] * samples.HEAD
        return [
            1.0,
            float(s.epochs),
            float(s.length),
            *s.first,
            float(s.repeated),
            *head,
            float(len(new)),
            *new.reshape(-1).tolist(),
        ]

    def compare_samples(self, rows: list[torch.Tensor], step: int, line: str | None) -> list[tuple[str, Finding]]:
        """The data-split-twice and shared-samples findings in every rank's `vector`
        (each with the key it is said once under); the table of seen samples grows."""
        if len(rows) < 2 or not all(bool(r[0] == 1) and len(r) > WIDTH for r in rows):
            return []
        heads = [r[WIDTH : WIDTH + samples.HEAD] for r in rows]
        found = []
        twice = samples.split_twice(heads, line)
        if twice is not None:
            found.append(("data-split", twice))
        start = WIDTH + samples.HEAD + 1
        prints = [r[start : start + 2 * int(r[start - 1])].reshape(-1, 2) for r in rows]
        self.seen.add(int(rows[0][1]), prints)
        if self.seen.overlapping():
            found.append(("data-shared", Finding("data", True, samples.shared_text(self.seen, step, heads, line))))
        return found

    def boundary(self) -> bool:
        """Whether the training loader has started its second epoch."""
        return self.current is not None and self.current.epochs >= 2


def compare(rows: list[torch.Tensor], step: int, line: str | None) -> list[tuple[str, Finding]]:
    """The findings in every rank's `vector` at a checked step (see the module), each
    with the key it is said once under."""
    if len(rows) < 2 or not all(bool(r[0] == 1) for r in rows):
        return []
    found = []
    lengths = [int(r[2]) for r in rows]
    if min(lengths) >= 0 and len(set(lengths)) > 1:
        found.append(("data-uneven", Finding("data", False, _uneven_text(lengths, line))))
    epochs = {int(r[1]) for r in rows}
    firsts = torch.stack([r[3:5] for r in rows]).view(torch.int64)
    if len(epochs) == 1 and bool((firsts == firsts[0]).all()):
        found.append(("data-same", Finding("data", True, _same_text(step, len(rows), int(rows[0][1]), line))))
    repeated = [rank for rank, r in enumerate(rows) if bool(r[5] == 1)]
    if repeated:
        found.append(("data-order", Finding("data", False, _order_text(int(rows[0][1]), repeated, len(rows), line))))
    return found


def _uneven_text(lengths: list[int], line: str | None) -> str:
    per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(lengths))
    return (
        f"the training DataLoader{_where(line)} has a different number of batches per epoch on "
        f"each rank ({per_rank}): at the end of an epoch the ranks with more batches wait for "
        "the others in a collective (a hang), or take steps the others do not. Fix: a "
        "DistributedSampler (it pads every rank to the same count) or drop_last=True; for "
        "truly uneven data, torch.distributed.algorithms.Join around the loop."
    )


def _same_text(step: int, world: int, epoch: int, line: str | None) -> str:
    return (
        f"step {step}: every rank got the same first batch in epoch {epoch} from its "
        f"DataLoader{_where(line)}: each rank trains on the same samples, so the {world} ranks "
        "repeat one rank's work and the averaged gradient is one batch's. Fix: give the "
        "DataLoader a torch.utils.data.DistributedSampler(dataset) as `sampler=` (and no "
        "shuffle=True on the loader), and call sampler.set_epoch(epoch) each epoch."
    )


def _order_text(epoch: int, ranks: list[int], world: int, line: str | None) -> str:
    who = "every rank" if len(ranks) == world else f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    return (
        f"epoch {epoch}: the shuffling sampler of the DataLoader{_where(line)} kept the epoch "
        f"number of the epoch before (on {who}), "
        "so every epoch replays the same order. Fix: call sampler.set_epoch(epoch) at the "
        "start of each epoch, before the loop over the loader."
    )


def _where(line: str | None) -> str:
    return f" iterated at {line}" if line else ""
