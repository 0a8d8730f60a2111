"""The process: group lifetime, device binding, seeds and rank information
(process_group.py), small device-aware collectives (collectives.py), and fault
injection at named points of a step (fault_injection.py).
"""

from disttrain.runtime.process_group import (RankInfo, barrier, distributed, init, rank_info, seed_all,
                                             seed_rank_stream, seed_step, shutdown)

__all__ = ["RankInfo", "barrier", "distributed", "init", "rank_info", "seed_all", "seed_rank_stream",
           "seed_step", "shutdown"]
