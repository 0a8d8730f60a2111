"""What a restarted or resized job needs beyond TorchElastic (docs/elastic.md).

    batch_policy.py  the global batch (or the LR) on a world-size change (P-ELASTIC-3, P-LOOP-4)
    sample_audit.py  the samples each step consumed, per attempt (P-DATA-3); the generation id
    preemption.py    SIGTERM/SIGINT -> an agreed stop, a save, exit 0 (P-ELASTIC-5)
"""

from disttrain.elastic.batch_policy import apply_batch_policy
from disttrain.elastic.preemption import PreemptionHandler
from disttrain.elastic.sample_audit import SampleAudit, final_timeline, generation_id

__all__ = ["PreemptionHandler", "SampleAudit", "apply_batch_policy", "final_timeline", "generation_id"]
