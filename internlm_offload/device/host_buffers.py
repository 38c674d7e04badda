"""Host memory: one allocation path (`Accelerator.host_empty`) and the two layouts built on it.

- `HostArena`: a fixed-layout slab. Many tensors as aligned views of one buffer, allocated once (the
  swap and hybrid optimizers' states and masters): one pinning call and one copy per chunk instead of
  thousands.
- `HostPool`: a recycling pool. Buffers pooled by byte size and handed out again once their last
  reader finished (the activation offloaders' transient copies), so no host memory is allocated after
  the first step.

Underneath, per backend: on cuda a large pinned buffer is ordinary memory registered with the driver
(`registered_empty`); on cpu host buffers are files mapped from `SHM_DIR` (`shm_empty`), so their pages
count as `RssShmem`, not as the `RssAnon` the cpu backend reports as device memory.
"""

from __future__ import annotations

import math
import os
import tempfile
import weakref
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from internlm_offload.device.accelerator import Accelerator
    from internlm_offload.device.streams import Event

# The cpu backend's host tier: a tmpfs directory (module global so tests can point it elsewhere).
SHM_DIR = "/dev/shm"
# Smaller host buffers use ordinary memory: a mapping costs at least a page and one of the process's maps.
SHM_MIN_BYTES = 4096
# cuda: pinned buffers from this size up are registered ordinary memory (exact size); smaller ones come
# from the caching host allocator, whose power-of-two rounding costs little there.
REGISTER_MIN_BYTES = 1 << 20
PAGE_BYTES = 4096
# Share of SHM_DIR left free for others (DataLoader workers, torch.multiprocessing): beyond it, ordinary memory.
SHM_RESERVE_FRACTION = 0.25


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
        specs: Sequence[tuple[torch.Size | tuple[int, ...], torch.dtype]],
        *,
        pinned: bool = True,
        alignment: int = ALIGNMENT,
        directory: str | None = None,
    ) -> None:
        if ALIGNMENT % alignment:
            raise ValueError(f"alignment={alignment} must divide {ALIGNMENT}")
        self.offsets, total = aligned_offsets(specs, alignment)
        self.specs = list(specs)
        self.nbytes = _align(total)
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
        shape, dtype = self.specs[index]
        start = self.offsets[index]
        nbytes = math.prod(shape) * dtype.itemsize
        return self.buffer[start : start + nbytes].view(dtype).view(shape)

    def release(self) -> None:
        """Free the buffer; views taken earlier keep their memory alive until dropped."""
        self.buffer = None
        if self.disk is not None:
            self.disk.release()


def aligned_offsets(
    specs: Sequence[tuple[torch.Size | tuple[int, ...], torch.dtype]], alignment: int
) -> tuple[list[int], int]:
    """Byte offsets of tensors packed in order, each starting on a multiple of `alignment`; and the end."""
    offsets, total = [], 0
    for shape, dtype in specs:
        total = _align(total, alignment)
        offsets.append(total)
        total += math.prod(shape) * dtype.itemsize
    return offsets, total


def _align(offset: int, alignment: int = ALIGNMENT) -> int:
    return (offset + alignment - 1) // alignment * alignment


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


# ---- allocation, per backend: registered pinned memory (cuda); on cpu, files mapped from SHM_DIR ------


def aligned_within(raw: torch.Tensor, nbytes: int, alignment: int) -> torch.Tensor:
    """The first `nbytes` of the flat uint8 `raw` that start on a multiple of `alignment` (allocate
    `nbytes + alignment` for them): plain allocations only promise 64-byte alignment."""
    start = -raw.data_ptr() % alignment
    return raw[start : start + nbytes]


def registered_empty(cudart: Any, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Page-aligned ordinary host memory registered with the driver (page-locked), unregistered with its storage.

    The registered pages lie wholly inside this allocation, so no other buffer shares them.
    """
    nbytes = shape.numel() * dtype.itemsize
    span = -(-nbytes // PAGE_BYTES) * PAGE_BYTES
    raw = torch.empty(span + PAGE_BYTES, dtype=torch.uint8)
    pages = aligned_within(raw, span, PAGE_BYTES)
    code = int(cudart.cudaHostRegister(pages.data_ptr(), span, 0))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of {span} bytes failed with error {code}")
    weakref.finalize(raw.untyped_storage(), cudart.cudaHostUnregister, pages.data_ptr())
    return pages[:nbytes].view(dtype).view(shape)


def shm_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous cpu tensor on a shared-memory storage, or an ordinary one when that is not possible."""
    nbytes = shape.numel() * dtype.itemsize
    storage = _shm_storage(nbytes) if nbytes >= SHM_MIN_BYTES else None
    if storage is None:
        return torch.empty(shape, dtype=dtype)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def _shm_storage(nbytes: int) -> torch.UntypedStorage | None:
    """`nbytes` of storage mapped from a fresh file in SHM_DIR, unlinked at once; None when that fails."""
    try:
        fs = os.statvfs(SHM_DIR)
        if (fs.f_bavail * fs.f_frsize - nbytes) < SHM_RESERVE_FRACTION * fs.f_blocks * fs.f_frsize:
            return None
        fd, path = tempfile.mkstemp(prefix="internlm_offload-", dir=SHM_DIR)
    except OSError:
        return None
    try:
        # Reserve the pages now: on a full tmpfs a first touch of a sparse mapping would raise SIGBUS.
        os.posix_fallocate(fd, 0, nbytes)
        return torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    except (OSError, RuntimeError):
        return None
    finally:
        os.close(fd)  # the mapping keeps the pages; once unlinked they go with the last mapping
        with suppress(OSError):
            os.unlink(path)
