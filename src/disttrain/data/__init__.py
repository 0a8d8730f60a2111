"""Data for the ranks: samplers that give each rank its disjoint shard of one global
order depending only on (seed, epoch), token files as a dataset, Hugging Face datasets
folders, and `disttrain data prepare`.

    distributed_sampler.py  DistributedSampler whose epoch advances itself (P-DATA-1, P-DATA-2)
    elastic_sampler.py      ElasticSampler: (epoch, cursor) state, exactly-once at any world size
    token_files.py          TokenWindows: nanoGPT and llm.c token files as a map-style dataset
    hf_data.py              a Hugging Face `datasets` folder ([data] hf_dataset)
    prepare.py              `disttrain data prepare`: text into token files
    data_command.py         the `disttrain data` command
"""

from disttrain.data.distributed_sampler import DistributedSampler, epoch_permutation
from disttrain.data.elastic_sampler import ElasticSampler
from disttrain.data.token_files import TokenWindows

__all__ = ["DistributedSampler", "ElasticSampler", "TokenWindows", "epoch_permutation"]
