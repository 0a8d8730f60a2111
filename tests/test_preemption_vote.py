"""The preemption vote on real gloo ranks under torchrun: a SIGTERM that reaches one
rank stops every rank after the same step (the step after the one it arrived in), and
a vote left in flight on a destroyed group is dropped without waiting on it."""

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import worker_env

pytestmark = pytest.mark.timeout(180)

# Rounds of (rank signalled, step of the signal); a fresh handler per round. The last
# round has no signal: nobody may stop.
ROUNDS = [(1, 3), (2, 6), (0, 1), (None, None)]
STEPS = 10

AGREEMENT = """
    import json, os, random, signal, sys, time
    import torch.distributed as dist
    from disttrain import runtime
    from disttrain.elastic.preemption import PreemptionHandler

    out, rounds, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    info = runtime.init(backend="gloo", device="cpu", timeout_s=60)
    random.seed(info.rank)
    seen = []
    for signalled, at in rounds:
        h = PreemptionHandler(grace_s=30).install()
        stopped = None
        for step in range(1, steps + 1):
            time.sleep(random.random() * 0.02)  # ranks reach the vote at different times
            if info.rank == signalled and step == at:
                os.kill(os.getpid(), signal.SIGTERM)
            if h.should_stop():
                stopped = step
                break
        seen.append({"stopped": stopped, "signal": h.signal_name})
        h.uninstall()
        dist.barrier()  # the next round starts with every rank's vote read or dropped
    open(f"{out}/rank{info.rank}.json", "w").write(json.dumps(seen))
    runtime.shutdown()
"""

DEAD_GROUP = """
    import json, os, signal, sys
    import torch.distributed as dist
    from disttrain import runtime
    from disttrain.elastic.preemption import PreemptionHandler

    out = sys.argv[1]
    info = runtime.init(backend="gloo", device="cpu", timeout_s=60)
    h = PreemptionHandler(grace_s=30).install()
    assert not h.should_stop() and not h.should_stop()
    if info.rank == 1:
        os._exit(0)  # a peer dies: rank 0's next vote can never complete
    h.should_stop()  # a vote in flight on a group that is about to lose rank 1
    runtime.shutdown(collect=False)  # as an in-memory recovery does
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    first = h.should_stop()  # must not wait on (or raise from) the dead group's vote
    os.kill(os.getpid(), signal.SIGTERM)
    second = h.should_stop()  # a world of 1 answers at once
    open(f"{out}/rank0.json", "w").write(json.dumps([first, second, h.signal_name]))
    h.uninstall()
    runtime.shutdown()
"""


def torchrun(tmp_path, code: str, nproc: int, *args: str) -> list:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(code))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(script), str(tmp_path), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=worker_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_next_step(tmp_path):
    ranks = torchrun(tmp_path, AGREEMENT, 3, json.dumps(ROUNDS), str(STEPS))
    assert len(ranks) == 3
    for k, (signalled, at) in enumerate(ROUNDS):
        stops = [r[k]["stopped"] for r in ranks]
        expected = None if at is None else at + 1  # the vote of step `at` is read at `at` + 1
        assert stops == [expected] * 3, f"round {k}: rank {signalled} signalled at {at}: {stops}"
        if signalled is not None:
            names = [r[k]["signal"] for r in ranks]
            assert names == ["SIGTERM" if rank == signalled else "peer" for rank in range(3)]


def test_a_vote_in_flight_on_a_dead_group_is_dropped_not_waited_on(tmp_path):
    (rank0,) = torchrun(tmp_path, DEAD_GROUP, 2)
    assert rank0 == [False, True, "SIGTERM"]
