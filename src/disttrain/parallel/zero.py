"""Moved to `disttrain.parallel.optimizers`; this path goes away in the next release."""

from disttrain.old_paths import forward

__getattr__ = forward(__name__)
