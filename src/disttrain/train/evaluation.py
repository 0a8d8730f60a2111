"""Held-out evaluation as a part of `dt.Job` (and so of `disttrain train`): an eval set
sharded across ranks, global metrics from (sum, count), a user metric hook, its own
period, and a slow phase for the hang watchdog.

    ev = job.evaluator(eval_set, batch_size=64, every=50)          # loss only
    ev = job.evaluator(eval_set, batch_size=64, every=50,
                       metric=lambda model, batch: {"loss": model(**batch).loss,
                                                    "accuracy": (n_correct, n)})

Sharding (P-LOOP-2): of the first n = min(len(dataset), max_batches x batch_size x
world) samples, rank r takes r, r + world, ...; every sample counts once. Every rank
runs as many forwards as the fullest one (FSDP all-gathers in each): a rank with
fewer samples runs its last batch on a repeated sample weighted 0. A metric value is
either a per-sample mean of its batch (a float or a 0-d tensor, weighted by the batch
size) or a (sum, count) pair; the global value is the sum over ranks of the sums over
the sum of the counts (one all-reduce for all metrics), never a mean of rank means.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch

from disttrain import runtime
from disttrain.config.tp_rules import dp_coordinates
from disttrain.errors import UserError
from disttrain.guard import tensor_nbytes
from disttrain.train.batches import batch_loss, to_device
from disttrain.train.global_metrics import global_sum

Metric = Callable[[torch.nn.Module, Any], dict]


def eval_shard(dataset_len: int, batch_size: int, max_batches: int | None, tp: int = 1) -> tuple[list[int], int]:
    """This rank's evaluation samples and the most any rank holds (see the module); the
    `tp` ranks of one tensor-parallel group share a data-parallel rank, and its samples."""
    info = runtime.rank_info()
    rank, world = dp_coordinates(info.rank, info.world_size, tp)
    n = dataset_len if not max_batches else min(dataset_len, max_batches * batch_size * world)
    return list(range(rank, n, world)), math.ceil(n / world)


def loss_metric(loss_fn: Callable | None = None) -> Metric:
    """The default metric: {"loss": the batch's loss} (`batches.batch_loss`). A batch the
    model rejects is one `UserError` naming the batch's structure (the evaluation at the
    start is often a run's first forward)."""
    return lambda model, batch: {"loss": batch_loss(model, batch, loss_fn, first=True)}


def check_name(name: str, taken: list[str]) -> None:
    """A new evaluator's name: a lowercase identifier, not in `taken`, and not "train".
    Each is one `UserError` naming the fix."""
    if name == "train":
        # The loop's own loss is already `train_loss` to people: the summary's
        # `final_train_loss`, TensorBoard's `loss/train`; an evaluator's `train_loss`
        # would silently replace it there.
        raise UserError(
            "dt.Job.evaluator(name='train'): 'train' is the training loop's own loss "
            "(final_train_loss, TensorBoard loss/train); name the evaluator for its data, "
            "e.g. name='train_sample' (logged as train_sample_loss)."
        )
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name in taken:
        raise UserError(
            f"dt.Job.evaluator(name={name!r}): each evaluator needs its own name, a "
            f"lowercase identifier (its metrics are '<name>_loss', ...); taken: "
            f"{', '.join(map(repr, taken)) or 'none'}."
        )


def _sum_count(name: str, value: Any, n: int) -> tuple[float, float]:
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return float(value[0]), float(value[1])
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().double()) * n, float(n)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) * n, float(n)
    raise UserError(
        f"the eval metric {name!r} returned {type(value).__name__}; return a number "
        f"(a mean over the batch) or a (sum, count) pair."
    )


class Evaluator:
    """One eval set of a job: what `job.evaluator(...)` returns (build it there, not
    directly). The job evaluates `model` on `dataset` every `every` optimizer steps (0:
    only at the last step) and at the last step; `at_start` also before the first step
    of a fresh run; it records each metric as `<name>_<metric>` in metrics.jsonl.

    Each evaluation runs under `torch.no_grad()` with the model in `eval()` mode
    (dropout off, batch-norm statistics frozen); the model's own mode is restored after
    it, also when a forward raises. `run(model)` is a collective returning {metric:
    global value}.

    Attributes:
        last: The newest evaluation's {metric: global value}, keyed without the name
            (`{"loss": 2.31}` for `heldout_loss`); {} before the first. The same on
            every rank.
        seconds: How long the newest evaluation took."""

    def __init__(
        self,
        dataset,
        batch_size: int,
        *,
        every: int = 0,
        max_batches: int | None = None,
        metric: Metric | None = None,
        collate: Callable | None = None,
        at_start: bool = False,
        name: str = "heldout",
        tp: int = 1,
    ):
        if batch_size < 1 or every < 0 or (max_batches is not None and max_batches < 1):
            raise UserError(
                f"evaluator: batch_size ({batch_size}) and max_batches ({max_batches}) "
                f"must be >= 1, every ({every}) >= 0."
            )
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise UserError(
                f"evaluator: the eval set is a {type(dataset).__name__}; pass a map-style "
                f"dataset (with __len__ and __getitem__) so it can be split across ranks."
            )
        self.dataset, self.batch_size, self.every = dataset, batch_size, every
        self.max_batches, self.at_start, self.name = max_batches, at_start, name
        self.tp = tp
        self.metric = metric or loss_metric()
        self.collate = collate or torch.utils.data.default_collate
        self.last: dict[str, float] = {}
        self.seconds = 0.0
        """How long the last evaluation took (what a preempted run must still fit)."""

    def due(self, step: int, max_steps: int) -> bool:
        return step >= max_steps or bool(self.every and step % self.every == 0)

    def forwards(self) -> int:
        """Forwards per rank of one evaluation."""
        _, per_rank = eval_shard(len(self.dataset), self.batch_size, self.max_batches, self.tp)
        return max(1, math.ceil(per_rank / self.batch_size))

    def slow_nbytes(self, model: torch.nn.Module) -> int:
        """What the watchdog's slow-phase bound scales with: every forward reads the
        whole model, so the bound grows with the eval's size and the model's."""
        return self.forwards() * tensor_nbytes(model)

    @torch.no_grad()
    def run(self, model: torch.nn.Module) -> dict[str, float]:
        import time

        t0, info = time.perf_counter(), runtime.rank_info()
        was_training = model.training
        model.eval()
        mine, per_rank = eval_shard(len(self.dataset), self.batch_size, self.max_batches, self.tp)
        sums: dict[str, list[float]] = {}
        try:
            for b in range(math.ceil(per_rank / self.batch_size)):
                ids = mine[b * self.batch_size : (b + 1) * self.batch_size]
                weight = 1.0 if ids else 0.0  # a padding batch: forwards, counts nothing
                batch = to_device(self.collate([self.dataset[i] for i in (ids or [0])]), info.device)
                for name, value in self.metric(model, batch).items():
                    s, c = _sum_count(name, value, max(1, len(ids)))
                    acc = sums.setdefault(name, [0.0, 0.0])
                    acc[0], acc[1] = acc[0] + s * weight, acc[1] + c * weight
        finally:
            model.train(was_training)
        names = sorted(sums)  # the same order on every rank
        totals = global_sum([v for n in names for v in sums[n]])
        self.last = {
            n: (totals[2 * i] / totals[2 * i + 1] if totals[2 * i + 1] else float("nan")) for i, n in enumerate(names)
        }
        self.seconds = time.perf_counter() - t0
        return self.last


def evaluate(
    evaluators: list[Evaluator], model: torch.nn.Module, guard, due: Callable[[Evaluator], bool]
) -> dict[str, float]:
    """Run each evaluator `due` selects, in the order built, each as a slow phase of the
    guard's watchdog; returns {"<name>_<metric>": value}. A collective: every rank
    calls it with the same `due` answers."""
    result: dict[str, float] = {}
    for ev in evaluators:
        if due(ev):
            with guard.slow_phase("eval", nbytes=ev.slow_nbytes(model)):
                result.update({f"{ev.name}_{k}": v for k, v in ev.run(model).items()})
    return result
