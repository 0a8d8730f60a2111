"""`python -m disttrain.train.script_runner SCRIPT [ARGS]`: a user's `dt.Job` script under
in-process fast recovery (`disttrain run --fast-recovery --nproc N script.py`).

The slot supervisor starts this as the slot's training process and as its warm spare
(docs/elastic.md). `elastic.fast_recovery.run` owns the generations: in each one the
script runs from the top as `__main__` (as `python SCRIPT ARGS` would), and its
`dt.Job` finds the generation's handoff (`fast_recovery.current()`): it joins the
generation's process group instead of starting one, takes its state from a
survivor's memory (or, under FSDP and ZeRO-1, from the buddy copies) in
`job.resume`, and registers what a recovery keeps after each step. When a peer dies
the collective that notices fails, the script's frames unwind, and the survivors run
the script again in the next generation with the promoted spare: the model, data and
optimizer are rebuilt and the state of the last committed step is loaded into them,
so the run ends bit-identical to an uninterrupted one with every sample once.

The group's settings come from the environment, since the script's `dt.Job(...)`
runs only later: DISTTRAIN_FAST_TIMEOUT_S (default 300) and the backend and device
'auto' (gloo on CPU).
"""

from __future__ import annotations

import os
import runpy
import sys

from disttrain import worker_notes
from disttrain.elastic import fast_recovery
from disttrain.runtime import failures

TIMEOUT_ENV = "DISTTRAIN_FAST_TIMEOUT_S"


def _body(script: str, args: list[str]):
    def body(info, handoff) -> int:
        sys.argv = [script, *args]
        try:
            runpy.run_path(script, run_name="__main__")
        except (SystemExit, KeyboardInterrupt) as e:  # a preempted Job exits 0; a user error 2
            if failures.is_program_exit(e) and worker_notes.under_launcher():
                # outside a Job (a Job judged its own): the program's, never a new generation
                failures.report_program_error(e, info.rank, None)
                worker_notes.wait_to_be_stopped()
                raise SystemExit(failures.exit_status(e)) from None
            if isinstance(e, KeyboardInterrupt) or e.code not in (None, 0):
                raise
        # Before this generation's group closes: a peer whose collective fails when it
        # does must find why (a rank that ended while its peers train), not recover.
        worker_notes.note_finished(info.rank)
        return 0

    return body


def main(argv: list[str]) -> int:
    if not argv:
        print(
            "usage: python -m disttrain.train.script_runner SCRIPT [ARGS] (started by `disttrain run --fast-recovery`)",
            file=sys.stderr,
        )
        return 2
    script, args = argv[0], argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` does
    timeout_s = float(os.environ.get(TIMEOUT_ENV) or 300.0)
    from disttrain.runtime.process_group import hold_script_groups

    hold_script_groups()  # the script's own destroy_process_group must not hang its exit
    failures.watch_interrupts()
    failures.record_native_crashes()
    return fast_recovery.run(_body(script, args), backend="auto", device="auto", timeout_s=timeout_s, seed=0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
