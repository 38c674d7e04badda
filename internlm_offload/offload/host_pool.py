"""Reusable host buffers for the offload paths, so that no host memory is allocated after the first step.

A buffer may come back while a copy still reads it (a prefetch that backward never used): it then
carries that copy's event, and the compute stream waits on it before the buffer is handed out again,
so the next offload's copy (ordered after the compute stream) cannot overwrite it early.
"""

from dataclasses import dataclass

import torch

from internlm_offload.device import Accelerator, Event


@dataclass
class PendingCopy:
    """The H2D copy that may still read some host buffers; None once the compute stream waited on it."""

    event: Event | None = None


class HostPool:
    """Host buffers (uint8, pinned where the device supports it) pooled by byte size."""

    def __init__(self, accelerator: Accelerator, pin_memory: bool) -> None:
        self.accelerator = accelerator
        self.pin_memory = pin_memory
        self.free: dict[int, list[tuple[torch.Tensor, Event | None]]] = {}
        self.allocated_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of `nbytes` bytes: a returned one once its last reader finished, else a new one."""
        bucket = self.free.get(nbytes)
        if bucket:
            buffer, reader = bucket.pop()
            if reader is not None:
                reader.wait()
            return buffer
        self.allocated_bytes += nbytes
        return self.accelerator.host_empty((nbytes,), torch.uint8, pinned=self.pin_memory)

    def give_back(self, buffers: list[torch.Tensor], pending: PendingCopy | None = None) -> None:
        """Return buffers; `pending` names the copy that may still read them."""
        reader = pending.event if pending is not None else None
        for buf in buffers:
            self.free.setdefault(buf.numel(), []).append((buf, reader))

    def clear(self) -> None:
        self.free.clear()
        self.allocated_bytes = 0
