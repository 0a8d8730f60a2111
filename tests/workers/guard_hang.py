"""Worker: a rank that stops (SIGSTOP) inside a step, or skips a collective, under the
hang watchdog with test-sized bounds. The watchdog must end the job with a summary
naming rank 1; a clean exit of this script means the guard missed the hang."""

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import disttrain as dt
from disttrain.builtin import MLP, MLPConfig
from disttrain.guard.watchdog import Watchdog

out, mode = Path(sys.argv[1]), sys.argv[2]

with dt.distributed(seed=0, timeout_s=90) as info:
    r = info.rank
    wd = Watchdog(dir=out / "guard", hang_factor=5, hang_min_s=6.0, hang_cap_s=30.0, tick_s=0.25)
    with wd:
        # skip: no DDP, so the only collective is the metric; a skipped one shifts the
        # pairing by one (same shapes, silently) until rank 0 waits alone at the end.
        model = dt.wrap(MLP(MLPConfig())) if mode == "sigstop" else MLP(MLPConfig())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(40):
            with wd.phase("forward"):
                x, y = torch.randn(4, 16), torch.randn(4, 4)
                if mode == "sigstop" and r == 1 and step == 10:
                    os.kill(os.getpid(), signal.SIGSTOP)  # frozen mid-step, as under a debugger
                loss = model(x, y)[1]
            with wd.phase("backward"):
                loss.backward()  # DDP all-reduce: rank 0 waits here for a stopped rank 1
            opt.step()
            opt.zero_grad()
            if not (mode == "skip" and r == 1 and step == 10):  # a rank-specific branch
                with wd.phase("metrics"):
                    dt.global_mean(float(loss), 1)
            wd.step(step + 1)
        with wd.phase("final_barrier"):
            dist.barrier()
    (out / f"rank{r}.done").write_text("missed")
