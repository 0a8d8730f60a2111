"""Device-to-host copies of the state a fast recovery keeps, overlapped with training.

On CUDA the buddy copy (`elastic.buddy_copy`) writes each rank's state into a pinned
host buffer on a side stream, right after a step commits: the side stream first waits
for the compute stream (the state is final), the copies are asynchronous (the copy
engine, not the compute stream), each source is marked used by the side stream (its
memory is not reused before the copy ends), and an event marks their end. Before the
host sends the buffer (gloo reads it on its own thread) it waits for the event
(`HostCopy.wait`); the next step's kernels are queued after that, so the optimizer
never changes a tensor that is still being copied.

On the CPU every one of these is a no-op or a plain copy (no pinned memory, no stream,
no event), so the same code paths run in the CPU tests.
"""

from __future__ import annotations

import contextlib

import torch


def on_cuda(tensors) -> bool:
    return any(t.is_cuda for t in tensors)


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """An uninitialised uint8 host buffer; page-locked when `pinned` and CUDA exists
    (asynchronous copies need it)."""
    pin = pinned and torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class HostCopy:
    """One device's copies into host buffers: a side stream and its last event."""

    def __init__(self) -> None:
        self.stream: torch.cuda.Stream | None = None
        self.event: torch.cuda.Event | None = None

    def _stream(self, device: torch.device):
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=device)
        return self.stream

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (host view, source) pair: on a side stream without blocking the
        host when a source is on CUDA, else at once."""
        cuda = [src for _, src in pairs if src.is_cuda]
        if not cuda:
            for dst, src in pairs:
                dst.copy_(src)
            self.event = None
            return
        side = self._stream(cuda[0].device)
        side.wait_stream(torch.cuda.current_stream(cuda[0].device))  # the state is final
        with torch.cuda.stream(side):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                src.record_stream(side)  # its memory is not reused before the copy ends
            self.event = event = torch.cuda.Event()
            event.record(side)

    def wait(self) -> None:
        """The host waits until the copies are in the host buffers."""
        if self.event is not None:
            self.event.synchronize()

    def context(self):
        """For a copy back to the device (a newcomer's state): on the side stream."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
