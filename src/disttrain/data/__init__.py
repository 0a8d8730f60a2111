"""Samplers: each rank's disjoint shard of one global order that depends only on
(seed, epoch).

    distributed_sampler.py  DistributedSampler whose epoch advances itself (P-DATA-1, P-DATA-2)
    elastic_sampler.py      ElasticSampler: (epoch, cursor) state, exactly-once at any world size
    token_files.py          TokenWindows: nanoGPT and llm.c token files as a map-style dataset
"""

from disttrain.data.distributed_sampler import DistributedSampler, epoch_permutation
from disttrain.data.elastic_sampler import ElasticSampler
from disttrain.data.token_files import TokenWindows

__all__ = ["DistributedSampler", "ElasticSampler", "TokenWindows", "epoch_permutation"]
