"""Fault injection and the preemption handler, with real signals in real processes."""

import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import worker_env
from disttrain.runtime import fault_injection as faults
from disttrain.errors import UserError


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
