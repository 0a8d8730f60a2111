"""Worker: the multi-rank checkpoint checks, many cases per launch (P-CKPT-1..5,
P-FSDP-8). `ckpt_checks.py OUT PHASE`; each rank writes OUT/rank{r}.json.

save    (w=2) reference runs of N+M steps and N-step runs saved, ddp and fsdp; a
        sync and an async save of one state; an injected ENOSPC.
reshard (w=4) fsdp: save R4 with its full reference; load R1 (saved at w=1).
resume  (w=2) new process group: resume both runs for M steps; compare the sync
        and async saves; load R4 as ddp and compare; save R2; load copies of the
        sync save with one byte flipped in rank 0's or rank 1's shard.
crash   (w=2) save step 1, then step 2 with DISTTRAIN_FAULT armed by the test.
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from ckpt_common import build, full_state, mismatches, train

import disttrain as dt
from disttrain.checkpoint import CheckpointCorrupt, Checkpointer, CheckpointSaveError, latest_valid
from disttrain.runtime.fault_injection import set_faults

N, M = 3, 4
out, phase = Path(sys.argv[1]), sys.argv[2]
res: dict = {}

with dt.distributed(seed=0) as info:
    r = info.rank
    if phase == "save":
        for strat in ("ddp", "fsdp"):
            ref = build(strat)
            res[f"{strat}_ref_losses"] = train(ref, N + M)
            full = full_state(ref)
            if r == 0:
                torch.save(full, out / f"ref_{strat}.pt")
            state = build(strat)
            ck = Checkpointer(out / f"run_{strat}", keep_last=2)
            for _ in range(N):  # a checkpoint every step: retention keeps the last 2
                res.setdefault(f"{strat}_first_losses", []).extend(train(state, 1))
                ck.save(state)
            res[f"{strat}_dirs"] = sorted(p.name for p in (out / f"run_{strat}").glob("step-*"))
        # async (thread) vs sync of the same state, training continuing at once
        state = build("ddp")
        train(state, 2)
        Checkpointer(out / "sync").save(state)
        ack = Checkpointer(out / "async", async_mode="thread")
        res["async_returned"] = ack.save(state) is None
        train(state, 2)  # changes parameters and optimizer state in place
        res["async_dir"] = ack.wait().name
        # an injected full disk on rank 1 only: every rank reports, previous stays
        ck = Checkpointer(out / "enospc")
        ck.save(state)
        set_faults("enospc@checkpoint.shards:rank=1")
        state.step += 1
        try:
            ck.save(state)
            res["enospc_error"] = None
        except CheckpointSaveError as e:
            res["enospc_error"] = str(e)
        set_faults(None)
        res["enospc_latest"] = latest_valid(out / "enospc").name
        res["enospc_leftovers"] = sorted(p.name for p in (out / "enospc").glob(".tmp-*"))
        res["enospc_then_trained"] = len(train(state, 1)) == 1
    elif phase == "reshard":
        state = build("fsdp")
        train(state, N)
        dt.save(state, out / "R4")
        full = full_state(state)
        if r == 0:
            torch.save(full, out / "ref_R4.pt")
        fresh = build("fsdp")
        res["R1_loaded"] = str(dt.load(fresh, out / "R1"))
        full = full_state(fresh)
        if r == 0:
            res["R1_mismatch"] = mismatches(full, torch.load(out / "ref_R1.pt", weights_only=True))
            res["R1_keys"] = len(full)
    elif phase == "resume":
        for strat in ("ddp", "fsdp"):
            state = build(strat)
            res[f"{strat}_loaded"] = Checkpointer(out / f"run_{strat}").load(state).name
            res[f"{strat}_step"] = state.step
            res[f"{strat}_resumed_losses"] = train(state, M)
            full = full_state(state)
            if r == 0:
                ref = torch.load(out / f"ref_{strat}.pt", weights_only=True)
                res[f"{strat}_mismatch"] = mismatches(full, ref)
        a, b = build("ddp"), build("ddp")
        dt.load(a, out / "sync")
        dt.load(b, out / "async")
        fa, fb = full_state(a), full_state(b)
        res["async_vs_sync"] = mismatches(fa, fb) if r == 0 else []
        res["async_meta_equal"] = (a.step, a.epoch, a.sampler.state_dict(), a.scheduler.state_dict()) \
            == (b.step, b.epoch, b.sampler.state_dict(), b.scheduler.state_dict())
        state = build("ddp")
        dt.load(state, out / "R4")
        full = full_state(state)
        if r == 0:
            res["R4_as_ddp_mismatch"] = mismatches(full, torch.load(out / "ref_R4.pt", weights_only=True))
            res["R4_keys"] = len(full)
        dt.save(state, out / "R2")
        # each rank hashes only its share on load: a shard that another rank verifies
        # must still fail the load here, with the same message on every rank
        for victim in (0, 1):
            bad = out / f"corrupt_{victim}"
            if r == 0:
                shutil.copytree(out / "sync", bad)
                shard = next((bad / "step-00000002").glob(f"__{victim}_*.distcp"))
                data = bytearray(shard.read_bytes())
                data[len(data) // 2] ^= 0xFF
                shard.write_bytes(data)
            dt.barrier()
            try:
                res[f"corrupt_{victim}"] = f"loaded {dt.load(build('ddp'), bad)}"
            except CheckpointCorrupt as e:
                res[f"corrupt_{victim}"] = str(e)
    elif phase == "crash":
        state = build("ddp")
        ck = Checkpointer(out / "crash", keep_last=3)
        train(state, 1)
        ck.save(state)
        train(state, 1)
        ck.save(state)  # DISTTRAIN_FAULT fires here (step 2)
        res["survived"] = True
    (out / f"rank{r}.json").write_text(json.dumps(res))
