"""Fault injection and the preemption handler, with real signals in real processes."""

import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import worker_env

from disttrain.errors import UserError
from disttrain.runtime import fault_injection as faults


def run_py(code: str, env_extra: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=worker_env(**(env_extra or {})))


def test_parse_and_errors():
    (f,) = faults.parse("kill@backward:rank=1,step=7")
    assert (f.action, f.phase, f.rank, f.step, f.restart) == ("kill", "backward", 1, 7, 0)
    assert len(faults.parse("stop@forward; exit@step:code=3")) == 2
    for bad in ("explode@forward", "kill", "kill@x:rank=one", "kill@x:color=1"):
        with pytest.raises(UserError, match="fault"):
            faults.parse(bad)


@pytest.mark.parametrize("spec, returncode", [
    ("kill@backward:rank=0,step=2", -signal.SIGKILL),
    ("exit@step:step=2,code=7", 7),
])
def test_fault_fires_only_at_its_point(spec, returncode):
    proc = run_py("""
        from disttrain.runtime import fault_injection as faults
        for step in range(4):
            for phase in ("forward", "backward", "step"):
                faults.inject(phase, step)
                print(step, phase, flush=True)
    """, {"DISTTRAIN_FAULT": spec})
    assert proc.returncode == returncode
    phase = spec.split("@")[1].split(":")[0]
    last = proc.stdout.strip().splitlines()[-1]
    assert last == {"backward": "2 forward", "step": "2 backward"}[phase]


def test_fault_does_not_fire_after_a_restart():
    proc = run_py("from disttrain.runtime import fault_injection as faults; faults.inject('step', 1); print('ok')",
                  {"DISTTRAIN_FAULT": "kill@step:step=1", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert proc.returncode == 0 and "ok" in proc.stdout


def test_sigterm_requests_a_stop_and_second_sigint_exits_now():
    proc = run_py("""
        import os, signal
        from disttrain.elastic.preemption import PreemptionHandler
        h = PreemptionHandler(grace_s=30).install()
        assert not h.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        print("stop", h.should_stop(), h.signal_name, h.time_left() <= 30, flush=True)
        os.kill(os.getpid(), signal.SIGINT)   # first SIGINT after SIGTERM: already requested
        print("unreachable", flush=True)
    """)
    assert proc.stdout.splitlines()[0] == "stop True SIGTERM True"
    assert proc.returncode == 130 and "unreachable" not in proc.stdout


@pytest.mark.parametrize("spec, word", [("kill@bakward", "'bakward'"), ("kil@backward", "'kil'"),
                                        ("exit@checkpoint.shard:step=2", "'checkpoint.shard'")])
def test_typo_in_phase_or_action_is_one_clear_error(spec, word):
    with pytest.raises(UserError) as err:
        faults.parse(spec)
    msg = str(err.value)
    assert word in msg and "unknown" in msg
    valid = faults.PHASES if "phase" in msg else faults.ACTIONS
    assert all(v in msg for v in valid)
    for phase in faults.PHASES:  # every real fault point stays accepted
        assert faults.parse(f"kill@{phase}:step=1")[0].phase == phase


def test_typo_in_DISTTRAIN_FAULT_fails_before_any_worker_starts():
    proc = run_py("""
        import sys
        from disttrain.cli import main
        sys.exit(main(["run", "--nproc", "2", "-m", "no_such_module"]))
    """, {"DISTTRAIN_FAULT": "kill@bakward:rank=1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "unknown phase 'bakward'" in proc.stderr and "Traceback" not in proc.stderr


def test_optional_work_after_a_signal_must_leave_the_grace_for_the_save(monkeypatch):
    import time

    from disttrain.elastic.preemption import PreemptionHandler

    h = PreemptionHandler(grace_s=10)
    assert h.time_for(1e9)  # no signal: any optional work runs
    h.requested_at = time.monotonic()  # as the SIGTERM handler sets it
    assert h.time_for(4)  # ~10 s left; 4 s of eval still keeps 5 s (half) for the save
    assert not h.time_for(6)
    h.requested_at -= 8  # 2 s left: too little for anything but the save
    assert not h.time_for(0)
    monkeypatch.setenv("DISTTRAIN_PREEMPT_GRACE_S", "45")  # what `disttrain run` exports
    assert PreemptionHandler().grace_s == 45 and PreemptionHandler(grace_s=5).grace_s == 5
