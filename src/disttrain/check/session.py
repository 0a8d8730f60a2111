"""The checks of `disttrain run --check`, installed from outside the user's script.

`install_from_env()` (called by `launch.worker_entry` before the script runs, when
`DISTTRAIN_CHECK` is set) puts in place, with public torch APIs only:
- torch's global optimizer step hooks (`register_optimizer_step_pre_hook`, `_post_`):
  every checked step compares gradients and replicas before it, replicas after it;
- the global module hooks of `model_watch` (models, DDP wrappers, `.module` bypass);
- the DataLoader wrapper of `data`;
- the `torch.distributed` collectives' wrappers of `collective_watch`: each call, optimizer
  step and the script's end compared across ranks, through a store, before it can hang.
- the wrappers of `results` (printed numbers, torch.save, RNG restores, GradScaler).

The window: the first N optimizer steps (`--check-steps`, default 50, or all), and the
first step of the training loader's second epoch. When it closes every hook is removed
and the summary is printed on rank 0 (or at the end of the script, if sooner). A step
inside another optimizer's step (ZeroRedundancyOptimizer's local optimizer) is not one.

Whether a step is checked depends only on numbers every rank shares (the step count,
and the epoch boundary once the ranks were seen to have equal epochs), so each checked
step's exchange is matched on every rank. A failure of the checks' own code turns them
off with one warning; it never reaches the user's program.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from disttrain.check import data, dead_gradients, micro_steps, replicas, results, wrapping, zeroing
from disttrain.check.channel import Channel
from disttrain.check.collective_watch import CollectiveWatch
from disttrain.check.model_watch import ModelWatch
from disttrain.check.settings import ALL, window_from_env
from disttrain.check.verdicts import Finding, Report, user_line
from disttrain.runtime.log import EVERY_RANK, LOGGER

HEAD = 4
"""Numbers before the parameters' in a rank's row at a checked step: the parameter count,
whether the optimizer holds parameters no model has, the parameters that carried
gradients over from the step before, whether the results checks have a record to
exchange."""


class Session:
    """One process's checks: `install`, then torch calls the hooks; `finish` at the end."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.steps = self.checked = 0
        self.channel, self.report = Channel(), Report()
        self.models, self.data, self.replicas = ModelWatch(), data.DataWatch(), replicas.Replicas()
        self.resets = zeroing.GradResets()
        self.zero_grads = dead_gradients.ZeroStreak()
        self.collectives = CollectiveWatch(self.report, window)
        self.stepping: Any = None
        """The optimizer whose step is running (a nested step is not checked)."""
        self.pending: tuple[list[torch.Tensor], replicas.Context] | None = None
        self.boundary_seen = self.aligned = self.closed = False
        """aligned: the training loader had the same known length on every rank."""
        self.world = 1
        self.seen_opts: set[int] = set()
        self._handles: list[Any] = []
        self.results = results.Results(
            self.models, self.channel, self.report, lambda: self.steps, self._upcoming, self.settle
        )

    def install(self) -> None:
        self._handles = [register_optimizer_step_pre_hook(self._before), register_optimizer_step_post_hook(self._after)]
        self.models.install()
        self.data.install()
        self.results.install()
        self.collectives.install()  # last: its wrapper of destroy_process_group is outermost, so
        # a rank's end reaches its peers before the results' last exchange waits for them

    def close(self) -> None:
        """End the window: the module hooks and the DataLoader wrapper removed, the
        summary printed, once. The optimizer hooks stay (returning at once) until
        `finish`: this is called from inside them, while torch iterates over them."""
        if self.closed:
            return
        self.closed = True
        self._pause()
        self.data.remove()
        self.collectives.remove()
        self.results.remove()
        LOGGER.info(self.report.summary(self.checked, self.boundary_seen, self.world))

    def _pause(self) -> None:
        """The window is over but the epoch boundary is still to come: only the
        DataLoader wrapper (to see the boundary) and the optimizer hooks stay; the
        per-module and per-parameter hooks go, so the steps in between run at full speed."""
        if not self.data.paused:
            self.data.paused = True
            self.models.remove()
            self.resets.remove()

    def uninstall(self) -> None:
        """The optimizer hooks removed (`finish`: no step of this process runs them now)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def settle(self) -> None:
        """End the window at a point every rank reaches alike (the step after it, the
        script's end): the results' last exchange, then `close`."""
        if not self.closed:
            self._guarded(self._exchange_results, None, None)
            self.close()

    def _wanted(self, steps: int) -> bool:
        if self.window == ALL or steps <= self.window:
            return True
        return self.aligned and not self.boundary_seen and self.data.boundary()

    def _upcoming(self) -> int | None:
        """The next optimizer step's number when it will be checked, else None."""
        return None if self.closed or not self._wanted(self.steps + 1) else self.steps + 1

    def _exchange_results(self, params: list[torch.Tensor] | None, line: str | None) -> None:
        if not self.results.exchange(self.steps, params, line):
            self.close()

    def _before(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.closed or (self.stepping is not None and self.stepping is not opt):
            return  # the local optimizer of a ZeroRedundancyOptimizer, inside its step
        if all(float(group.get("lr", 1.0)) == 0.0 for group in opt.param_groups):
            return  # changes nothing: torch's own step that makes the optimizer's state (DCP)
        self.stepping, self.pending = opt, None
        self.steps += 1
        self.collectives.step()  # first: a rank elsewhere is named here, not deadlocked below
        taken = self.models.take_step(), self.models.take_micro_steps()  # this step's only
        if not self._wanted(self.steps):
            if self.boundary_seen or not self.aligned:
                self.settle()
            else:
                self._pause()
            return
        self._guarded(self._check_before, opt, *taken)

    def _after(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if opt is not self.stepping:
            return
        self.stepping = None
        if not self.data.paused:  # paused or closed: the gradient hooks are gone already
            self.resets.stepped([p for group in opt.param_groups for p in group["params"]])
        if self.pending is not None and not self.closed:
            self._guarded(self._check_after)

    def _guarded(self, check: Any, *args: Any) -> None:
        try:
            check(*args)
        except Exception as e:  # noqa: BLE001  (the checks' own fault must never reach the script)
            LOGGER.warning(
                f"disttrain --check: the checks failed ({type(e).__name__}: {e}) and stop.", extra=EVERY_RANK
            )
            self.close()

    def _check_before(self, opt: torch.optim.Optimizer, model: tuple, micro: tuple[int, int, str | None]) -> None:
        params = [p for group in opt.param_groups for p in group["params"]]
        roots, bypass = model
        line = user_line()
        if micro_steps.all_synced(micro[0], micro[1]):
            nbytes = self.models.ddp_grad_bytes()
            self.report.add(micro_steps.all_synced_finding(self.steps, micro[0], micro[2], nbytes))
        elif micro[0] > 1:
            self.report.note("accumulation", f"{micro[0]} micro-batches per step, no_sync() on all but the last")
        whole = replicas.plain(params)
        head = [float(len(whole)), float(wrapping.orphaned(params, roots)), float(self.resets.carried(whole))]
        head.append(float(self.results.pending(params)))
        rows = self.channel.gather([*head, *replicas.before_values(whole), *self.data.vector()])
        if rows is None:
            return self.close()
        if any(bool(r[3]) for r in rows):
            self._exchange_results(params, line)
        self.resets.watch(whole)
        self.checked, self.world = self.checked + 1, len(rows)
        first = id(opt) not in self.seen_opts
        self.seen_opts.add(id(opt))
        if any(bool(r[1]) for r in rows):
            self.report.add(Finding("wrapping", True, wrapping.orphaned_text(self.steps, len(params), roots, line)))
        self.report.note("optimizer", "holds the model's parameters")
        self._compare_data([r[HEAD + 4 * int(r[0]) :] for r in rows], line)
        carried = max(int(r[2]) for r in rows)
        if carried:
            self.report.add(zeroing.carried_finding(self.steps, carried, len(whole), line))
        self.report.note("zero_grad", "gradients reset between steps")
        ctx = replicas.Context(self.steps, first, self._names(whole), line, bypass, self.models.outside_sync())
        if len({int(r[0]) for r in rows}) != 1:
            self.report.note("replicas", "not compared: the ranks' optimizers hold different parameters")
            return
        body = [r[HEAD : HEAD + 4 * int(r[0])] for r in rows]
        self._check_unused(whole, body, ctx)
        if self.zero_grads.add(dead_gradients.all_zero(body)):
            self.report.add(dead_gradients.finding(self.steps, len(whole), line))
        self.report.note("gradients", "not all zero")
        ddp = self.models.ddp_params()
        own = torch.tensor([id(p) in ddp for p in whole], dtype=torch.bool)
        self.report.add(self.replicas.before(body, own, ctx))
        self.pending = (whole, ctx)
        self._note_replicas(bool(own.any()), sharded=len(whole) < len(params))

    def _check_unused(self, whole: list[torch.Tensor], body: list[torch.Tensor], ctx: replicas.Context) -> None:
        """Parameters a strict DDP waits for, without a gradient on any rank."""
        strict = self.models.strict_params()
        if not strict or ctx.no_sync:
            return
        no_grad = torch.stack([b.reshape(-1, 4)[:, 1] < 0 for b in body]).all(dim=0)
        unused = [ctx.names[i] for i, p in enumerate(whole) if id(p) in strict and bool(no_grad[i])]
        if unused:
            self.report.add(Finding("wrapping", True, wrapping.unused_text(ctx.step, unused, ctx.step_line)))
        self.report.note("unused parameters", "every parameter DDP waits for got a gradient")

    def _check_after(self) -> None:
        assert self.pending is not None
        whole, ctx = self.pending
        named = self.models.buffers({id(p) for p in whole})
        mine = replicas.after_values([*whole, *(b for _, b in named)])
        rows = self.channel.gather(mine)
        if rows is None:
            return self.close()
        if len({len(r) for r in rows}) != 1:
            return  # the models' buffers differ in number: not comparable
        self.report.add(self.replicas.after(rows, len(whole), [n for n, _ in named], ctx))

    def _compare_data(self, rows: list[torch.Tensor], line: str | None) -> None:
        where = self.data.current.line if self.data.current else line
        found = [*data.compare(rows, self.steps, where), *self.data.compare_samples(rows, self.steps, where)]
        for key, finding in found:
            self.report.add(finding, key)
        present = all(bool(r[0] == 1) for r in rows)
        lengths = {int(r[2]) for r in rows}
        self.aligned = present and len(lengths) == 1 and min(lengths) >= 0
        if present:
            epochs = {int(r[1]) for r in rows}
            self.boundary_seen = self.boundary_seen or (len(epochs) == 1 and min(epochs) >= 2)
            self.report.note("data", f"compared across ranks up to epoch {max(epochs)}")

    def _note_replicas(self, ddp: bool, sharded: bool) -> None:
        if self.replicas.replica is not None and bool(self.replicas.replica.any()):
            how = "DDP averages the gradients" if ddp else "the gradients are averaged"
            self.report.note("replicas", f"identical on every rank ({how})")
        elif sharded:
            self.report.note("replicas", "not compared: sharded parameters (DTensor), a shard per rank")
        else:
            self.report.note("replicas", "not compared: each rank trains its own parameters")

    def _names(self, params: list[torch.Tensor]) -> list[str]:
        known = self.models.names()
        return [
            known.get(id(p), f"parameter {i} of the optimizer, shape {tuple(p.shape)}") for i, p in enumerate(params)
        ]


SESSION: list[Session] = []
"""This process's session, once installed (a list: no global statement needed)."""


def install(window: int) -> Session:
    """This process's checks for `window` optimizer steps (`ALL`: every step), installed
    once: a second call returns the session already there (`disttrain run --check` and a
    `dt.Job(check=True)` in its script)."""
    if not SESSION:
        SESSION.append(Session(window))
        SESSION[0].install()
    return SESSION[0]


def install_from_env() -> Session | None:
    """Install the checks when `disttrain run --check` asked for them (DISTTRAIN_CHECK);
    None otherwise."""
    window = window_from_env()
    return None if window is None else install(window)


def finish() -> None:
    """The script ended: its end compared with the other ranks' (`CollectiveWatch.end`:
    first, so a rank that ends early is named, not waited for), the results' last
    exchange while the process group is up (`Session.settle`), the summary if not said
    yet, and every hook removed."""
    import torch.distributed as dist

    if SESSION:
        SESSION[0].collectives.end()
        failure = sys.exc_info()[1]  # during a failure a peer may be gone: no exchange
        clean = failure is None or (isinstance(failure, SystemExit) and failure.code in (None, 0))
        if clean and dist.is_available() and dist.is_initialized():
            SESSION[0].settle()
        SESSION[0].close()
        SESSION[0].uninstall()
