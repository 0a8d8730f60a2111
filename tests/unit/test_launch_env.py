"""The environment `disttrain run` hands torchrun and its workers: the user's own
settings stay, and what describes this job (its slots, its training world, its store,
its lease) is always this launcher's, whatever an outer job or an earlier one left."""

from __future__ import annotations

import os

import pytest

from disttrain.launch import run_command as launch

STALE = {
    "DISTTRAIN_TOTAL_SLOTS": "9",  # 7 standby slots that do not exist: a lost node would wait a lease
    "DISTTRAIN_TRAINING_WORLD": "5",
    "DISTTRAIN_NODE_LEASE_S": "60",
    "DISTTRAIN_FAST_STORE": "etcd://127.0.0.1:1",
    "DISTTRAIN_FAST_ROLE": "spare",
    "DISTTRAIN_EXPECTED_WORLD_SIZE": "8",
}


@pytest.fixture
def environ():
    """os.environ as the launch leaves it, put back whole afterwards."""
    saved = dict(os.environ)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def _launch_env(argv: list[str]) -> None:
    run = launch.torchrun_for(argv)
    launch._set_launch_env(run.args, run.env)


def test_a_stale_job_description_gives_way_to_this_jobs_and_the_users_settings_stay(environ):
    environ.update(STALE, OMP_NUM_THREADS="3")
    _launch_env(["--nproc", "2", "-m", "disttrain.train", "examples/tiny_gpt.toml",
                 "--elastic.fast_recovery=true", "--elastic.node_lease_s=2"])
    assert environ["DISTTRAIN_NODE_LEASE_S"] == "2"  # the flag, not the leftover
    assert environ["DISTTRAIN_EXPECTED_WORLD_SIZE"] == "2"
    for gone in ("DISTTRAIN_TOTAL_SLOTS", "DISTTRAIN_TRAINING_WORLD", "DISTTRAIN_FAST_STORE", "DISTTRAIN_FAST_ROLE"):
        assert gone not in environ, gone  # this job has none: its slot supervisors set their own
    assert environ["OMP_NUM_THREADS"] == "3"  # the user's setting wins over the launcher's default


def test_a_job_without_fast_recovery_hands_on_no_lease_either(environ):
    environ.update(STALE)
    _launch_env(["--nproc", "2", "-m", "disttrain.train", "examples/tiny_gpt.toml"])
    assert not set(STALE) - {"DISTTRAIN_EXPECTED_WORLD_SIZE"} & set(environ)
    assert environ["DISTTRAIN_EXPECTED_WORLD_SIZE"] == "2"
