"""The process: group lifetime, device binding, seeds and rank information
(process_group.py), small device-aware collectives (collectives.py), fault
injection at named points of a step (fault_injection.py), and process plumbing: the
parent-death signal, a name that says the rank, freezing the collector and the one
registry of process-wide state (processes.py).

The names below load process_group (and torch) on first use, so `runtime.log` (the
one logger) stays light for the launcher and a plain script's watchdog.
"""

__all__ = [
    "RankInfo",
    "barrier",
    "distributed",
    "freeze_long_lived",
    "init",
    "rank_info",
    "seed_all",
    "seed_rank_stream",
    "seed_step",
    "shutdown",
]


def __getattr__(name: str):
    if name == "freeze_long_lived":
        from disttrain.runtime import processes

        return processes.freeze_long_lived
    if name in __all__:
        from disttrain.runtime import process_group

        return getattr(process_group, name)
    raise AttributeError(f"module 'disttrain.runtime' has no attribute {name!r}")
