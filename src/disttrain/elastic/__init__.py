"""What a restarted or resized job needs beyond TorchElastic (docs/elastic.md).

batch_policy.py  the global batch (or the LR) on a world-size change (P-ELASTIC-3, P-LOOP-4)
sample_audit.py  the samples each step consumed, per attempt (P-DATA-3); the generation id
preemption.py    SIGTERM/SIGINT -> an agreed stop, a save, exit 0 (P-ELASTIC-5)
fast_recovery.py a dead rank replaced by a warm spare in the same generation, the state
                 from the survivors' memory (`[elastic] fast_recovery = true`)
buddy_copy.py    each rank's shard kept also in its buddy's CPU memory, for fast
                 recovery under FSDP
etcd_store.py    fast recovery's store on etcd under the etcd rendezvous (no node hosts it)
membership.py    which slots are still in a fast-recovery job: a lost node shrinks it in memory
liveness.py      a supervisor's socket, refused once its node's processes are gone (no lease)
generation_store.py  under etcd: the TCP store a generation's rank 0 hosts for its process groups
buddy_reshard.py after a shrink, the smaller world's shards from the larger world's buddy copies
host_copy.py     the buddy copies' device-to-host copies, overlapped with training
group_sockets.py a survivor cuts its failed groups' connections and no others
job_store.py     fast recovery's store as the ranks use it: values sealed with the job's secret
job_stop.py      a note that stops the job, shared through the store with every node
note_relay.py    that note on torchrun's restart path, relayed on the rendezvous' own store
join_node.py     `disttrain run --join`: a node admitted into a running job at a step boundary
"""

from disttrain.elastic.batch_policy import apply_batch_policy
from disttrain.elastic.preemption import PreemptionHandler
from disttrain.elastic.sample_audit import SampleAudit, final_timeline, generation_id

__all__ = ["PreemptionHandler", "SampleAudit", "apply_batch_policy", "final_timeline", "generation_id"]
