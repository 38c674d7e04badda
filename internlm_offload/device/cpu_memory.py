"""The cpu backend's memory readings: what `memory_allocated()` and `max_memory_allocated()` mean on cpu.

On a GPU `memory_allocated()` counts the bytes the caching allocator has handed out to tensors; the
free blocks it keeps for reuse are "reserved", not allocated. On cpu the same reading comes from glibc's
malloc (`mallinfo2`, glibc 2.33+): the heap chunks in use plus the blocks mapped on their own, so the
free chunks glibc keeps resident for reuse are left out as a device's reserve is. The host tier
(`host_empty`) lives in /dev/shm files, outside malloc, so offloading shows as a drop, as on a device.
Without `mallinfo2` the reading falls back to the process's anonymous resident memory (`RssAnon`),
with glibc's mmap threshold fixed (`mallopt`) so that freed large blocks at least leave it at once; it
then also counts the free heap chunks (the 4-block tiny config read ~40 % above its tensors that way).

malloc keeps no peak of its own: `PeakSampler` takes a reading every `SAMPLE_INTERVAL_S` on a daemon
thread; torch releases the GIL inside its kernels, so samples land during them. A peak shorter than the
interval can be missed.

`CpuMemory` puts them together against a baseline (`mark_baseline`, which the builder calls after the
start-up probe of `engine/runtime_memory.py` and before the model is built), so the runtime's own
memory (interpreter, libraries, kernel caches, the data set) is not counted, and it owns `BlockCache`,
the stand-in for the caching allocator: like `memory_allocated()` on a device, the readings leave out
the freed blocks it keeps for reuse.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
import weakref
from collections.abc import Callable

import torch

from internlm_offload.log import get_logger

logger = get_logger(__name__)

# Only for the `RssAnon` fallback: blocks of 1 MiB or more get mappings of their own, so freeing one
# returns it to the kernel; smaller tensors and Python objects stay on the heap.
MMAP_THRESHOLD_BYTES = 1 << 20
SAMPLE_INTERVAL_S = 0.0005
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (malloc.h): every field a size_t."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc_function(name: str) -> Callable | None:
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None


_MALLINFO2 = _libc_function("mallinfo2")
if _MALLINFO2 is not None:
    _MALLINFO2.restype, _MALLINFO2.argtypes = _MallInfo2, []


def malloc_in_use_bytes() -> int | None:
    """Bytes malloc has handed out and not had back (heap chunks in use plus blocks mapped on their own);
    None where libc has no `mallinfo2`. Takes each malloc arena's lock in turn: a few µs."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


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
    """Anonymous resident memory of this process (heap and anonymous mappings, free heap chunks included)."""
    return read_proc_status_kib("RssAnon") * 1024


def rss_shmem_bytes() -> int:
    """Resident shared memory of this process: the cpu backend's host tier (from `host_empty`)."""
    return read_proc_status_kib("RssShmem") * 1024


def host_rss_bytes() -> int:
    """Resident memory of this process, all kinds."""
    return read_proc_status_kib("VmRSS") * 1024


def device_memory_bytes() -> int:
    """The cpu backend's raw "device memory" reading: malloc's bytes in use, else `RssAnon` (docstring above)."""
    in_use = malloc_in_use_bytes()
    return rss_anon_bytes() if in_use is None else in_use


def serve_large_allocations_by_mmap(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes (process-wide); False where libc is not glibc.

    For the `RssAnon` fallback only: costs a page fault per 4 KiB on every large allocation, as a fresh
    device allocation would without a caching allocator; in return freed tensors leave `RssAnon` at once.
    """
    mallopt = _libc_function("mallopt")
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, threshold))


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


class PeakSampler:
    """Keeps the largest of `read()`'s values, taken every `interval_s` on a daemon thread.

    The thread holds the sampler weakly and ends with it, or at `stop()`.
    """

    def __init__(self, read: Callable[[], int], interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.read = read
        self._peak = read()
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=_sample,
            args=(weakref.ref(self), self._stopped, interval_s),
            name="device-memory-sampler",
            daemon=True,
        )
        self._thread.start()

    def peak(self) -> int:
        """The largest reading since the last `reset()`, a reading taken now included."""
        self.record(self.read())
        return self._peak

    def record(self, reading: int) -> None:
        self._peak = max(self._peak, reading)

    def reset(self) -> int:
        """The peak restarts from the reading now, which is returned."""
        self._peak = self.read()
        return self._peak

    def stop(self) -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            if self._thread is not threading.current_thread():
                self._thread.join()

    def __del__(self) -> None:
        self._stopped.set()


def _sample(ref: weakref.ref[PeakSampler], stopped: threading.Event, interval_s: float) -> None:
    # time.sleep, not `stopped.wait(interval_s)`: an Event's timed wait makes a lock and runs a Condition's
    # bookkeeping on every call, which at 2000 calls a second was about half of what the sampler cost (a tenth of
    # a tiny run's CPU); `stop()` now waits up to one interval.
    while not stopped.is_set():
        time.sleep(interval_s)
        sampler = ref()
        if sampler is None or stopped.is_set():
            return
        sampler.record(sampler.read())
        del sampler  # hold it only while sampling, so that it can be collected


class CpuMemory:
    """Device memory above a baseline, now and at its sampled peak; see the module docstring."""

    def __init__(self) -> None:
        self.blocks = BlockCache()
        self._baseline = 0
        self._sampler: PeakSampler | None = None
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[type, tuple]:
        return CpuMemory, ()  # a copy (another process, say) samples its own memory, with no cached blocks

    def mark_baseline(self) -> None:
        """From here on readings count from the reading now, and its peak is sampled."""
        if malloc_in_use_bytes() is None and not serve_large_allocations_by_mmap():
            logger.warning("libc has neither mallinfo2 nor mallopt: freed cpu tensors may stay in device memory")
        self._baseline = self._running_sampler().reset()

    def reading(self) -> int:
        """Device memory now, less cached blocks, from zero (not the baseline)."""
        return device_memory_bytes() - self.blocks.cached_bytes

    def allocated(self) -> int:
        """Device memory less cached blocks, above the baseline now (no sampling thread needed)."""
        return max(0, self.reading() - self._baseline)

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

    def _running_sampler(self) -> PeakSampler:
        with self._lock:
            if self._sampler is None:
                self._sampler = PeakSampler(self.reading)
            return self._sampler
