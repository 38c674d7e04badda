"""Host memory layouts over one allocation path (`Accelerator.host_empty`, `host_alloc` beneath it).

- `HostArena`: a fixed-layout slab. Many tensors as aligned views of one buffer, allocated once (the
  swap and hybrid optimizers' states and masters): one pinning call and one copy per chunk instead of
  thousands.
- `HostPool`: a recycling pool. Buffers pooled by byte size and handed out again once their last
  reader finished (the activation offloaders' transient copies), so no host memory is allocated after
  the first step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from internlm_offload.device.layout import TensorSpec, aligned_offsets, aligned_within, round_up, view_at
from internlm_offload.device.streams import Event

if TYPE_CHECKING:
    from internlm_offload.device.accelerator import Accelerator

# ---- the fixed-layout slab -------------------------------------------------------------------------

ALIGNMENT = 512  # bytes; keeps every view aligned for vectorised copies and DMA


class HostArena:
    """Host memory for tensors of the given shapes and dtypes, as views of one buffer.

    With `directory` the buffer is a file there, mapped (`Accelerator.disk_buffer`, the NVMe tier): the
    views read and write it through the page cache, and `prefetch` / `write_back` page byte ranges in
    ahead of use and out behind it; for host memory they do nothing.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        specs: Sequence[TensorSpec],
        *,
        pinned: bool = True,
        alignment: int = ALIGNMENT,
        directory: str | None = None,
    ) -> None:
        if ALIGNMENT % alignment:
            raise ValueError(f"alignment={alignment} must divide {ALIGNMENT}")
        self.offsets, total = aligned_offsets(specs, alignment)
        self.specs = list(specs)
        self.nbytes = round_up(total, ALIGNMENT)
        self.disk = None if directory is None else accelerator.disk_buffer(directory, self.nbytes)
        if self.disk is not None:
            self.buffer: torch.Tensor | None = self.disk.tensor[: self.nbytes]  # a mapping starts page-aligned
            return
        # Offsets are relative to the buffer, so the buffer itself starts aligned.
        raw = accelerator.host_empty((self.nbytes + ALIGNMENT,), torch.uint8, pinned=pinned)
        self.buffer = aligned_within(raw, self.nbytes, ALIGNMENT)

    def prefetch(self, start: int, nbytes: int) -> None:
        """Disk: start reading these bytes in (they are about to be copied)."""
        if self.disk is not None:
            self.disk.prefetch(start, nbytes)

    def write_back(self, start: int, nbytes: int) -> None:
        """Disk: write these bytes out and drop them from memory, behind (nothing writes them any more)."""
        if self.disk is not None:
            self.disk.write_back(start, nbytes)

    def span(self, start: int, nbytes: int) -> torch.Tensor:
        """Bytes `[start, start + nbytes)` of the buffer, as a flat uint8 view."""
        if self.buffer is None:
            raise RuntimeError("HostArena.span after release()")
        return self.buffer[start : start + nbytes]

    def view(self, index: int) -> torch.Tensor:
        """The tensor at slot `index` (uninitialised until written)."""
        if self.buffer is None:
            raise RuntimeError("HostArena.view after release()")
        return view_at(self.buffer, self.offsets[index], *self.specs[index])

    def release(self) -> None:
        """Free the buffer; views taken earlier keep their memory alive until dropped."""
        self.buffer = None
        if self.disk is not None:
            self.disk.release()


# ---- the recycling pool --------------------------------------------------------------------------


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
