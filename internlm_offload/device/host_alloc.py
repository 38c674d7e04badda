"""Host allocation, per backend: the memory under `Accelerator.host_empty`.

- cuda: a pinned buffer of `REGISTER_MIN_BYTES` or more is page-aligned ordinary memory registered with the
  driver (`registered_empty`): the caching host allocator behind `pin_memory=True` rounds every block up
  to a power of two, which would pin up to twice the bytes;
- cpu: host buffers are files mapped from `SHM_DIR` (`shm_empty`), so their pages count as `RssShmem`, not
  as the `RssAnon` the cpu backend reports as device memory.

The layouts built on these buffers (`HostArena`, `HostPool`) live in `host_buffers`, above the accelerator.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from contextlib import suppress
from typing import Any

import torch

from internlm_offload.device.layout import PAGE_BYTES, aligned_within, round_up

# The cpu backend's host tier: a tmpfs directory (module global so tests can point it elsewhere).
SHM_DIR = "/dev/shm"
# Smaller host buffers use ordinary memory: a mapping costs at least a page and one of the process's maps.
SHM_MIN_BYTES = 4096
# cuda: pinned buffers from this size up are registered ordinary memory (exact size); smaller ones come
# from the caching host allocator, whose power-of-two rounding costs little there.
REGISTER_MIN_BYTES = 1 << 20
# Share of SHM_DIR left free for others (DataLoader workers, torch.multiprocessing): beyond it, ordinary memory.
SHM_RESERVE_FRACTION = 0.25


def registered_empty(cudart: Any, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Page-aligned ordinary host memory registered with the driver (page-locked), unregistered with its storage.

    The registered pages lie wholly inside this allocation, so no other buffer shares them.
    """
    nbytes = shape.numel() * dtype.itemsize
    span = round_up(nbytes, PAGE_BYTES)
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
