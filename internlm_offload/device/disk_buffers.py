"""Disk memory (the NVMe tier): a file, mapped, whose pages the kernel moves between the disk and the host.

`DiskBuffer(directory, nbytes)` reserves `nbytes` of a new file in `directory` (`posix_fallocate`: a full
disk fails here, at start, not mid-run), unlinks it at once (nothing outlives the process, a crash
included: checkpoints are the durable copy) and maps it shared. Its `tensor` is an ordinary uint8 cpu
tensor over the mapping: views of it are read and written like host memory, through the page cache.

Host memory stays bounded because the user steers the kernel per byte range:
- `prefetch(start, n)`: `MADV_WILLNEED`, the kernel starts reading those pages in the background;
- `write_back(start, n)`: on the buffer's own thread, `msync` (the pages reach the disk) then drops them
  from the mapping and the page cache (`MADV_DONTNEED`, `POSIX_FADV_DONTNEED`). Dirty pages of a shared
  file mapping are never lost by dropping them: a later read faults the written bytes back in.
Why a mapping rather than pinned staging buffers filled by explicit reads: the states stay ordinary
tensors for `state_dict`, loads and DCP (which read them through the page cache, coherent with the
writes), and one NVMe drive (a few GB/s) is slower than a pageable host-to-device copy, so pinning the
staging would not make the step faster.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from internlm_offload.device.layout import PAGE_BYTES, round_up


class DiskSpaceError(OSError):
    """The directory cannot hold the buffer (missing, not writable, or too full): one line naming it."""


class DiskBuffer:
    """`nbytes` of a file under `directory`, mapped into memory (module docstring)."""

    def __init__(self, directory: str | Path, nbytes: int) -> None:
        directory = Path(directory)
        self.nbytes = round_up(max(nbytes, 1), PAGE_BYTES)
        try:
            fd, path = tempfile.mkstemp(prefix="optimizer_states.", suffix=".bin", dir=directory)
        except OSError as exc:
            raise DiskSpaceError(f"{directory}: cannot create a file there ({exc.strerror})") from None
        os.unlink(path)  # the mapping and the descriptor keep the file; nothing is left after the process
        try:
            os.posix_fallocate(fd, 0, self.nbytes)
        except OSError as exc:
            os.close(fd)
            free = shutil.disk_usage(directory).free
            raise DiskSpaceError(
                f"{directory}: cannot reserve {self.nbytes / 2**30:.2f} GiB ({exc.strerror}); "
                f"{free / 2**30:.2f} GiB free"
            ) from None
        self._fd = fd
        self._map = mmap.mmap(fd, self.nbytes)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="disk-write-back")
        self._pending: list[Future] = []

    def prefetch(self, start: int, nbytes: int) -> None:
        """Ask the kernel to start reading `[start, start + nbytes)` in."""
        lo, hi = _pages(start, nbytes, self.nbytes)
        if hi > lo:
            self._map.madvise(mmap.MADV_WILLNEED, lo, hi - lo)

    def write_back(self, start: int, nbytes: int) -> None:
        """Write `[start, start + nbytes)` to the disk and drop its pages from memory, on the buffer's thread.

        Call it once nothing writes the range any more (a copy into it has finished)."""
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._writer.submit(self._write_back, start, nbytes))

    def finish_writes(self) -> None:
        """Wait for the write-backs queued so far (re-raises their failure)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def resident_bytes(self) -> int:
        """Bytes of the mapping resident in this process's memory now (its `Rss` in /proc/self/smaps)."""
        return _mapping_rss(self._map)

    def release(self) -> None:
        """Finish the write-backs and stop the thread; views taken earlier keep the mapping alive."""
        self.finish_writes()
        self._writer.shutdown()
        self.tensor = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _write_back(self, start: int, nbytes: int) -> None:
        lo, hi = _pages(start, nbytes, self.nbytes)
        if hi <= lo:
            return
        self._map.flush(lo, hi - lo)
        self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        os.posix_fadvise(self._fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)


def _pages(start: int, nbytes: int, limit: int) -> tuple[int, int]:
    """The pages covering `[start, start + nbytes)`, within the buffer."""
    return start // PAGE_BYTES * PAGE_BYTES, min(round_up(start + nbytes, PAGE_BYTES), limit)


def _mapping_rss(mapped: mmap.mmap) -> int:
    """The `Rss` of the mapping that holds `mapped`'s first byte, from /proc/self/smaps (0 if not found)."""
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
    found = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= address < hi
            elif found and head == "Rss:":
                return int(line.split()[1]) * 1024
    return 0
