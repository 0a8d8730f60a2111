"""Moved to `disttrain.launch.notes_watch`; this path goes away in the next release."""

from disttrain.old_paths import forward

__getattr__ = forward(__name__)
