"""Moved to `disttrain.train.global_metrics`, `.rank0_output` and `.run_log`; this path goes away in the next release."""

from disttrain.old_paths import forward

__getattr__ = forward(__name__)
