"""The process: group lifetime, device binding, seeds and rank information
(process_group.py), small device-aware collectives (collectives.py), fault
injection at named points of a step (fault_injection.py), and process plumbing: the
parent-death signal and a name that says the rank (processes.py).

The names below load process_group (and torch) on first use, so `runtime.log` (the
one logger) stays light for the launcher and a plain script's watchdog.
"""

__all__ = ["RankInfo", "barrier", "distributed", "freeze_long_lived", "init", "rank_info", "seed_all",
           "seed_rank_stream", "seed_step", "shutdown"]


def __getattr__(name: str):
    if name in __all__:
        from disttrain.runtime import process_group

        return getattr(process_group, name)
    raise AttributeError(f"module 'disttrain.runtime' has no attribute {name!r}")
