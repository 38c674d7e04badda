"""The cpu backend's memory readings: what `memory_allocated()` and `max_memory_allocated()` mean on cpu.

On a GPU the caching allocator counts tensor bytes. On cpu the closest reading is the process's
anonymous resident memory (`RssAnon`: heap and anonymous mappings); the host tier (`host_empty`) lives
in /dev/shm files and counts as `RssShmem` instead, so offloading shows as a drop, as on a device. Two
things turn `RssAnon` into a reading of tensor memory:

- glibc gives a freed block back to the kernel only when the block had a mapping of its own, and by
  default it raises the size that gets one after every large free (up to 32 MiB), so freed activations
  would stay resident. `serve_large_allocations_by_mmap()` fixes that size: from then on every
  allocation of `MMAP_THRESHOLD_BYTES` or more is mapped on allocation and unmapped on free.
- the kernel keeps no peak of `RssAnon` (`VmHWM` counts the host tier, mapped files and the runtime).
  `AnonPeakSampler` reads /proc/self/statm every `SAMPLE_INTERVAL_S` on a daemon thread; torch releases
  the GIL inside its kernels, so samples land during them. A peak shorter than the interval can be missed.

`CpuMemory` puts them together against a baseline taken before the model is built, as the builder does,
so the runtime's own memory (interpreter, libraries, the data set) is not counted, and it owns
`BlockCache`, the stand-in for the caching allocator: like `memory_allocated()` on a device, the
readings leave out the freed blocks it keeps for reuse.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import weakref
from collections.abc import Callable

import torch

from internlm_offload.log import get_logger

logger = get_logger(__name__)

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
# Small tensors and Python objects stay on the heap, where reuse costs no page faults (the 4-block tiny
# config's steps keep their speed); activations of real models (MiBs each) get mappings of their own.
MMAP_THRESHOLD_BYTES = 1 << 20
SAMPLE_INTERVAL_S = 0.0005
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


def read_proc_status_kib(key: str) -> int:
    """One `key:` line of /proc/self/status, in KiB (0 where the kernel has no such line)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_anon_bytes() -> int:
    """Anonymous resident memory of this process: the cpu backend's "device memory"."""
    return read_proc_status_kib("RssAnon") * 1024


def rss_shmem_bytes() -> int:
    """Resident shared memory of this process: the cpu backend's host tier (from `host_empty`)."""
    return read_proc_status_kib("RssShmem") * 1024


def host_rss_bytes() -> int:
    """Resident memory of this process, all kinds."""
    return read_proc_status_kib("VmRSS") * 1024


def serve_large_allocations_by_mmap(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes (process-wide); False where libc is not glibc.

    Costs a page fault per 4 KiB on every large allocation, as a fresh device allocation would without
    a caching allocator; in return freed tensors leave `RssAnon` at once.
    """
    path = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(path).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


class BlockCache:
    """Freed `device_buffer`s of the cpu backend, reused at once (what a device's caching allocator does).

    A request takes the smallest cached block of at least its size (at most twice it) and gets a view
    of its first bytes; giving the view back returns the whole block.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.cached_bytes = 0  # kept up to date: the memory sampler reads it every interval

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fitting = [size for size, blocks in self._free.items() if blocks and nbytes <= size <= 2 * nbytes]
            if fitting:
                size = min(fitting)
                self.cached_bytes -= size
                return self._free[size].pop()[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8)

    def give_back(self, buffer: torch.Tensor) -> None:
        storage = buffer.untyped_storage()
        block = torch.empty(0, dtype=torch.uint8).set_(storage)
        with self._lock:
            self._free.setdefault(storage.nbytes(), []).append(block)
            self.cached_bytes += storage.nbytes()

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.cached_bytes = 0


class AnonPeakSampler:
    """Samples `RssAnon` (from /proc/self/statm: resident minus file and shared pages), less the bytes
    `reserved()` names, on a daemon thread.

    The thread holds the sampler weakly and ends with it, or at `stop()`.
    """

    def __init__(self, reserved: Callable[[], int] = lambda: 0, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self._reserved = reserved
        self._statm = os.open("/proc/self/statm", os.O_RDONLY)
        self._peak = self.read()
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=_sample, args=(weakref.ref(self), self._stopped, interval_s), name="rss-anon-sampler", daemon=True
        )
        self._thread.start()

    def read(self) -> int:
        """`RssAnon` less the reserve now, in bytes (statm: `resident - shared` pages; shared = file + shmem)."""
        fields = os.pread(self._statm, 128, 0).split()
        return (int(fields[1]) - int(fields[2])) * PAGE_BYTES - self._reserved()

    def peak(self) -> int:
        """The largest reading since the last `reset()`, a reading taken now included."""
        self.record(self.read())
        return self._peak

    def record(self, reading: int) -> None:
        if reading > self._peak:
            self._peak = reading

    def reset(self) -> int:
        """The peak restarts from the reading now, which is returned."""
        self._peak = self.read()
        return self._peak

    def stop(self) -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            if self._thread is not threading.current_thread():
                self._thread.join()

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:  # os may be gone at exit
        self._stopped.set()
        _close(self._statm)


def _sample(ref: weakref.ref[AnonPeakSampler], stopped: threading.Event, interval_s: float) -> None:
    while not stopped.wait(interval_s):
        sampler = ref()
        if sampler is None:
            return
        sampler.record(sampler.read())
        del sampler  # hold it only while sampling, so that it can be collected


class CpuMemory:
    """`RssAnon` above a baseline, now and at its sampled peak; see the module docstring."""

    def __init__(self) -> None:
        self.blocks = BlockCache()
        self._baseline = 0
        self._sampler: AnonPeakSampler | None = None
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[type, tuple]:
        return CpuMemory, ()  # a copy (another process, say) samples its own memory, with no cached blocks

    def mark_baseline(self) -> None:
        """From here on readings count from `RssAnon` now, freed tensors leave it, and its peak is sampled."""
        if not serve_large_allocations_by_mmap():
            logger.warning("libc has no mallopt: freed cpu tensors may stay resident and inflate device memory")
        self._baseline = self._running_sampler().reset()

    def allocated(self) -> int:
        """`RssAnon` less cached blocks, above the baseline now (no sampling thread needed)."""
        return max(0, rss_anon_bytes() - self.blocks.cached_bytes - self._baseline)

    def peak(self) -> int:
        """The sampled peak above the baseline since the last `reset_peak()` (or since sampling started)."""
        return max(0, self._running_sampler().peak() - self._baseline)

    def reset_peak(self) -> None:
        self._running_sampler().reset()

    def stop(self) -> None:
        """Stop the sampling thread; a later peak reading starts a new one."""
        with self._lock:
            sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.stop()

    def _running_sampler(self) -> AnonPeakSampler:
        with self._lock:
            if self._sampler is None:
                self._sampler = AnonPeakSampler(lambda: self.blocks.cached_bytes)
            return self._sampler
