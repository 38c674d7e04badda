"""The cpu backend's device-memory readings: tensor memory above a baseline, freed memory leaving it
(glibc's free chunks not counted), a sampled peak, and the `RssAnon` fallback (`cpu_memory.py`)."""

import gc
import multiprocessing
import threading
import time

import torch

from internlm_offload.device import Accelerator, cpu_memory

MIB = 1 << 20


def _new_sampler_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Sampling threads started since `before` (other tests' accelerators may still be ending theirs)."""
    return [t for t in threading.enumerate() if t.name == "device-memory-sampler" and t not in before]


def _hold(nbytes: int) -> list[torch.Tensor]:
    """Written tensors of 4 MiB each (resident, not just reserved)."""
    return [torch.ones(MIB, dtype=torch.float32) for _ in range(nbytes // (4 * MIB))]


def _in_fresh_process(readings) -> None:
    """Run `readings` in a spawned process. For the `RssAnon` fallback: in a test worker the heap holds other
    tests' freed blocks, and a new 4 MiB tensor can reuse resident ones and not move the reading (seen in
    full runs: 105 MB read for 128 MiB held; a peak of 40 MiB for 64 MiB held, the same figure twice)."""
    child = multiprocessing.get_context("spawn").Process(target=readings)
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0, "the readings in the child failed (its traceback is on stderr above)"


def test_freed_tensors_leave_device_memory() -> None:
    _freed_tensors_leave_device_memory()


def test_freed_tensors_leave_the_rss_anon_fallback() -> None:
    """Without `mallinfo2` the reading is `RssAnon`, with glibc's mmap threshold fixed at the baseline."""
    _in_fresh_process(_freed_tensors_leave_rss_anon)


def _freed_tensors_leave_rss_anon() -> None:
    cpu_memory._MALLINFO2 = None  # the fresh process's own module: as on a libc without mallinfo2
    assert cpu_memory.malloc_in_use_bytes() is None
    _freed_tensors_leave_device_memory()


def _freed_tensors_leave_device_memory() -> None:
    acc = Accelerator("cpu")
    # glibc's default raises its mmap threshold past a freed mapping's size: after this, 4 MiB blocks would
    # come from the heap, and freed ones between live ones would stay resident: malloc's in-use count leaves
    # them out, and the `RssAnon` fallback fixes the threshold at the baseline.
    torch.empty(16 * MIB, dtype=torch.uint8).fill_(1)
    gc.collect()
    acc.mark_memory_baseline()
    start = acc.memory_allocated()
    held = _hold(128 * MIB)
    # Slack for what else the process frees or allocates meanwhile (other tests' threads ending).
    assert 112 * MIB <= acc.memory_allocated() - start <= 144 * MIB
    del held[::2]  # every other block: the heap could not give these back
    assert 48 * MIB <= acc.memory_allocated() - start <= 80 * MIB
    del held
    assert acc.memory_allocated() - start < 16 * MIB
    acc.close_streams()


def test_free_heap_chunks_are_not_device_memory() -> None:
    """glibc keeps freed small blocks resident for reuse, as a caching allocator keeps its reserve: the
    reading leaves them out (`RssAnon` did not: the tiny config read 52 MiB for a 37 MiB step)."""
    acc = Accelerator("cpu")
    acc.mark_memory_baseline()
    start = acc.memory_allocated()
    held = [torch.ones(16 * 1024, dtype=torch.float32) for _ in range(1024)]  # 64 KiB each: heap chunks
    assert 56 * MIB <= acc.memory_allocated() - start <= 72 * MIB
    del held[::2]  # freed chunks between live ones: the heap cannot shrink, they stay resident
    assert 24 * MIB <= acc.memory_allocated() - start <= 40 * MIB
    acc.close_streams()


def test_peak_is_sampled_between_readings() -> None:
    _peak_is_sampled_between_readings()


def _peak_is_sampled_between_readings() -> None:
    acc = Accelerator("cpu")
    acc.mark_memory_baseline()
    acc.reset_peak_memory_stats()
    held = _hold(64 * MIB)
    # Many sampling intervals; under load the sampler may not run for a while, so wait for a reading that
    # holds the buffer (up to 2 s: a sampler that never samples still fails below).
    deadline = time.monotonic() + 2.0
    time.sleep(0.05)
    while acc.max_memory_allocated() < 56 * MIB and time.monotonic() < deadline:
        time.sleep(0.01)
    del held
    now = acc.memory_allocated()
    assert acc.max_memory_allocated() - now >= 48 * MIB  # slack for what other threads free meanwhile
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() - acc.memory_allocated() < 8 * MIB
    acc.close_streams()


def test_host_tier_is_not_device_memory() -> None:
    acc = Accelerator("cpu")
    acc.mark_memory_baseline()
    host = acc.host_empty((64 * MIB,), torch.uint8)
    host.fill_(1)
    assert acc.memory_allocated() < 8 * MIB
    del host
    acc.close_streams()


def test_sampling_thread_ends_with_close_or_with_the_accelerator() -> None:
    before = set(threading.enumerate())
    acc = Accelerator("cpu")
    acc.reset_peak_memory_stats()
    (first,) = _new_sampler_threads(before)
    acc.close_streams()
    assert not first.is_alive()
    acc.reset_peak_memory_stats()  # a later reading samples again
    (second,) = _new_sampler_threads(before | {first})
    del acc
    # The thread holds the sampler strongly while it samples: a collection that runs then leaves the accelerator's
    # cycle for the next one (seen in CI under load), so collect until the thread saw it go, for up to 2 s.
    for _ in range(20):
        gc.collect()
        second.join(timeout=0.1)
        if not second.is_alive():
            break
    assert not second.is_alive()


def test_cached_device_buffers_are_not_device_memory() -> None:
    """A device's `memory_allocated()` leaves out the caching allocator's free blocks; so does the cpu's."""
    acc = Accelerator("cpu")
    acc.mark_memory_baseline()
    buffer = acc.device_buffer(64 * MIB)
    buffer.fill_(1)
    assert acc.memory_allocated() >= 60 * MIB
    acc.free_device_buffer(buffer)
    del buffer
    assert acc.memory_allocated() < 8 * MIB
    acc.reset_peak_memory_stats()
    time.sleep(0.01)
    assert acc.max_memory_allocated() < 8 * MIB
    acc.close_streams()


def test_memory_kept_by_a_probe_is_what_it_leaves_behind() -> None:
    """`Accelerator.memory_kept_by`: on cpu, malloc's growth across the probe (what kernels keep); the
    device memory in use before the run is the host's, not counted (0)."""
    acc = Accelerator("cpu")
    kept: list[torch.Tensor] = []

    def probe_that_keeps_8_mib() -> None:
        kept.append(torch.ones(2 * MIB, dtype=torch.float32))
        torch.ones(16 * MIB, dtype=torch.uint8).sum()  # freed before it returns

    # malloc's counters are the process's: other threads (gc, a previous test's stream workers) may free
    # a few bytes during the probe, so the floor allows 64 KiB below the 8 MiB kept.
    assert 8 * MIB - 64 * 1024 <= acc.memory_kept_by(probe_that_keeps_8_mib) < 10 * MIB
    assert acc.memory_kept_by(lambda: torch.ones(16 * MIB, dtype=torch.uint8).sum()) < 2 * MIB
    assert acc.device_memory_in_use() == 0
    acc.close_streams()
