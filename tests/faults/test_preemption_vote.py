"""The preemption vote on real gloo ranks under torchrun: a SIGTERM that reaches one
rank stops every rank after the same step (with short steps at the next vote's read,
with long ones the signal's own step), and a vote left in flight on a destroyed group
is dropped without waiting on it."""

import json
import subprocess
import textwrap

import pytest
from conftest import run_cmd, worker_env

from disttrain.elastic.preemption import VOTE_EVERY_MAX

pytestmark = pytest.mark.timeout(180)

# Rounds of (rank signalled, step of the signal, each rank's grace, step every rank must
# stop after); a fresh handler per round. Steps take 0-5 ms, 10-30 ms on rank 2.
# A grace of 1e4 s makes every step short: votes start at calls 1, 2 (the step time is
# known from then), 2 + E, 2 + 2E, ... and are read at the next call. Rank 2's grace
# of 0.5 s makes steps long (over 1 % of it): from the third call every call votes and
# reads its own vote, and the ranks with a long grace must follow. The last round has
# no signal: nobody stops.
E = VOTE_EVERY_MAX
LONG, SHORT = [1e4] * 3, [1e4, 1e4, 0.5]
ROUNDS = [(1, 3, LONG, 3 + E), (2, 2 + E, LONG, 3 + E), (0, 3 + E, LONG, 3 + 2 * E),
          (0, 1, LONG, 2), (0, 6, SHORT, 6), (None, None, LONG, None)]
STEPS = 3 * E

AGREEMENT = """
    import json, os, random, signal, sys, time
    import torch.distributed as dist
    from disttrain import runtime
    from disttrain.elastic.preemption import PreemptionHandler

    out, rounds, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    REGROUP_FROM = 4  # rank 0 asks the group to regroup from this step on
    info = runtime.init(backend="gloo", device="cpu", timeout_s=60)
    random.seed(info.rank)
    seen = []
    for signalled, at, graces, _ in rounds:
        h = PreemptionHandler(grace_s=graces[info.rank]).install()
        stopped = regrouped = None
        for step in range(1, steps + 1):  # ranks reach the vote at different times
            time.sleep(0.01 + random.random() * 0.02 if info.rank == 2 else random.random() * 0.005)
            if info.rank == signalled and step == at:
                os.kill(os.getpid(), signal.SIGTERM)
            stopping = h.should_stop(regroup=info.rank == 0 and step >= REGROUP_FROM)
            if h.regroup_agreed and regrouped is None:
                regrouped = step
            if stopping:
                stopped = step
                break
        seen.append({"stopped": stopped, "signal": h.signal_name, "regrouped": regrouped})
        h.uninstall()
        dist.barrier()  # the next round starts with every rank's vote read or dropped
    open(f"{out}/rank{info.rank}.json", "w").write(json.dumps(seen))
    runtime.shutdown()
"""

DEAD_GROUP = """
    import json, os, signal, sys, time
    import torch.distributed as dist
    from disttrain import runtime
    from disttrain.elastic.preemption import VOTE_EVERY_MAX, PreemptionHandler

    out = sys.argv[1]
    info = runtime.init(backend="gloo", device="cpu", timeout_s=60)
    h = PreemptionHandler(grace_s=1e4).install()
    assert not h.should_stop() and not h.should_stop()  # on every rank: vote 2 in flight
    if info.rank == 2:
        while not all(os.path.exists(f"{out}/posted{r}") for r in (0, 1)):
            time.sleep(0.05)
        os._exit(0)  # a peer dies: the next vote of ranks 0 and 1 can never complete
    for _ in range(VOTE_EVERY_MAX):  # reads vote 2, starts vote 2 + E, which rank 2 never joins
        h.should_stop()
    open(f"{out}/posted{info.rank}", "w").close()
    runtime.shutdown(collect=False)  # as an in-memory recovery does, then a new group
    dist.init_process_group("gloo", store=dist.FileStore(f"{out}/store", 2), rank=info.rank,
                            world_size=2)
    seen = [h.should_stop()]  # must not wait on (or raise from) the dead group's vote
    if info.rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    seen += [h.should_stop(), h.should_stop(), h.signal_name]
    open(f"{out}/rank{info.rank}.json", "w").write(json.dumps(seen))
    h.uninstall()
    runtime.shutdown()
"""


def torchrun(tmp_path, code: str, nproc: int, *args: str) -> list:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(code))
    cmd = run_cmd(nproc, str(script), str(tmp_path), *args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=worker_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_next_step(tmp_path):
    ranks = torchrun(tmp_path, AGREEMENT, 3, json.dumps(ROUNDS), str(STEPS))
    assert len(ranks) == 3
    for k, (signalled, at, _, expected) in enumerate(ROUNDS):
        stops = [r[k]["stopped"] for r in ranks]
        assert stops == [expected] * 3, f"round {k}: rank {signalled} signalled at {at}: {stops}"
        if signalled is not None:
            names = [r[k]["signal"] for r in ranks]
            assert names == ["SIGTERM" if rank == signalled else "peer" for rank in range(3)]
        # Rank 0's request to regroup, from step 4, rides on the same votes: every rank
        # learns it at the same step, never before it was asked, within one vote's lag.
        regrouped = {r[k]["regrouped"] for r in ranks}
        assert len(regrouped) == 1, f"round {k}: {regrouped}"
        (step,) = regrouped
        assert step is None or 4 <= step <= 4 + E + 1, f"round {k}: regrouped at {step}"
    assert ranks[0][-1]["regrouped"] is not None  # the round nobody stops learns it
    assert ranks[0][4]["regrouped"] == 4  # long steps: the step's own vote carries it


def test_a_vote_in_flight_on_a_dead_group_is_dropped_not_waited_on(tmp_path):
    ranks = torchrun(tmp_path, DEAD_GROUP, 3)
    # a new group votes afresh: the signal of the second call is read at the third
    assert ranks == [[False, False, True, "peer"], [False, False, True, "SIGTERM"]]
