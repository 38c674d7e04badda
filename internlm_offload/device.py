"""Accelerator layer: the one place that talks to `torch.cuda` / `torch.npu`.

Trainer, offload and optimizer code ask an `Accelerator` for devices, process-group backends, host
buffers, memory statistics, streams and events, so the same code runs on cuda, npu (through
`torch_npu`) and cpu. On cpu, "device memory" is the process's anonymous resident memory (`RssAnon`,
read as tensor memory by `cpu_memory`) and host buffers from `host_empty` live in unlinked /dev/shm
files (`RssShmem`), so moving data to the host shows up as a drop in "device memory" as on a GPU. A
side stream is a worker thread with a FIFO queue: copies submitted to it really run beside the main
thread (torch releases the GIL), so a missing wait shows up as wrong data in cpu tests.

Portable pattern (on cpu, work reaches a side stream only through `Stream.submit`):

    copy_stream.wait_stream(acc.current_stream())  # the source is ready
    acc.copy_async(host_buf, device_tensor, copy_stream)
    done = copy_stream.record_event()
    ...
    done.wait()  # the current stream waits before it reuses or frees either buffer
"""

from __future__ import annotations

import importlib.util
import os
import queue
import sys
import tempfile
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from internlm_offload.cpu_memory import CpuMemory

BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}

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


class StreamError(RuntimeError):
    """Work queued on a cpu side stream failed; the original exception is `__cause__`."""


class Stream(ABC):
    """An in-order queue of device work that runs beside the host."""

    @abstractmethod
    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run `fn(*args, **kwargs)` on this stream."""

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Work submitted after this call starts only once `event` has completed."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until everything submitted so far has run."""

    @abstractmethod
    def _new_event(self) -> Event: ...

    def wait_stream(self, other: Stream) -> None:
        """Later work on this stream waits for everything submitted to `other` so far."""
        self.wait_event(other.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        """Record `event` (a new one when None) at this point of the stream and return it."""
        event = self._new_event() if event is None else event
        event.record(self)
        return event

    def close(self) -> None:
        """Release what the stream holds (cpu: its worker thread); idempotent."""


class Event(ABC):
    """A marker in a stream; complete once the stream has run everything submitted before it."""

    @abstractmethod
    def record(self, stream: Stream | None = None) -> None:
        """Mark the current end of `stream` (default: current); re-recording moves the mark."""

    @abstractmethod
    def wait(self, stream: Stream | None = None) -> None:
        """Make `stream` (default: the current stream) wait for this event."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the event is complete."""

    @abstractmethod
    def query(self) -> bool:
        """True once the event is complete; an event never recorded is complete."""


@dataclass(frozen=True)
class Accelerator:
    """A device type plus the torch module that drives it (`torch.cuda`, `torch.npu`, or none for cpu)."""

    name: str  # "cuda" | "npu" | "cpu"
    # Per-instance cpu stream state; not part of equality, hashing or repr.
    _streams: _StreamRegistry = field(default_factory=lambda: _StreamRegistry(), init=False, compare=False, repr=False)
    _memory: CpuMemory = field(default_factory=lambda: CpuMemory(), init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.name == "npu" and not hasattr(torch, "npu"):
            # torch.npu exists only once torch_npu is imported: import it here rather than fail on first use
            try:
                import torch_npu  # noqa: F401
            except ImportError:
                raise ValueError("Accelerator('npu') needs torch_npu: pip install torch_npu") from None
        if self.name != "cpu" and not hasattr(torch, self.name):
            raise ValueError(
                f"Accelerator({self.name!r}): torch has no {self.name!r} device module; use cuda, npu or cpu"
            )

    @property
    def module(self) -> Any:
        """`torch.cuda` / `torch.npu`; None on cpu."""
        return None if self.name == "cpu" else getattr(torch, self.name)

    @property
    def dist_backend(self) -> str:
        return BACKENDS[self.name]

    @property
    def supports_pinned_memory(self) -> bool:
        # Pinning needs a driver; torch raises on a machine without one.
        return self.name != "cpu"

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu") if self.name == "cpu" else torch.device(self.name, local_rank)

    def set_device(self, local_rank: int) -> None:
        if self.module is not None:
            self.module.set_device(local_rank)

    def synchronize(self) -> None:
        """Block until all streams are idle (cpu: every open side stream)."""
        if self.module is not None:
            self.module.synchronize()
            return
        for stream in self._streams.side_streams():
            stream.synchronize()

    def manual_seed_all(self, seed: int) -> None:
        if self.module is not None:
            self.module.manual_seed_all(seed)

    def rng_state(self) -> torch.Tensor | None:
        return None if self.module is None else self.module.get_rng_state()

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        if self.module is not None and state is not None:
            self.module.set_rng_state(state)

    def host_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, pinned: bool = True) -> torch.Tensor:
        """An uninitialised host buffer: page-locked when asked for and supported; on cpu in shared memory.

        On cpu the buffer is mapped from an unlinked file in `SHM_DIR`, so its pages count as `RssShmem`,
        not as the `RssAnon` that `memory_allocated()` reports. It is an ordinary cpu tensor except that
        it cannot be resized past its size and stays shared with children forked after its creation.
        Buffers under `SHM_MIN_BYTES`, and every buffer when `SHM_DIR` is missing, not writable or would
        keep less than `SHM_RESERVE_FRACTION` of its space free, use ordinary memory.

        On cuda a pinned buffer of `REGISTER_MIN_BYTES` or more is ordinary memory registered with the
        driver (`cudaHostRegister`, released with the storage): the caching host allocator behind
        `pin_memory=True` rounds every block up to a power of two, which would pin up to twice the bytes.
        """
        if self.module is None:
            return _shm_empty(torch.Size(shape), dtype)
        pinned = pinned and self.supports_pinned_memory
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if pinned and nbytes >= REGISTER_MIN_BYTES and hasattr(self.module, "cudart"):
            return _registered_empty(self.module.cudart(), torch.Size(shape), dtype)
        return torch.empty(shape, dtype=dtype, pin_memory=pinned)

    def device_memory_bytes(self, local_rank: int = 0) -> int | None:
        """Total memory of the device `local_rank` uses; None on cpu, whose "device" memory is the host's."""
        if self.module is None:
            return None
        return int(self.module.get_device_properties(local_rank).total_memory)

    def host_worker(self, name: str) -> Executor:
        """A host thread for CPU work that overlaps the device's (the hybrid optimizer's CPU step)."""
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def current_device(self) -> torch.device:
        """The device this process computes on now (`set_device`'s)."""
        return torch.device("cpu") if self.module is None else torch.device(self.name, self.module.current_device())

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of uninitialised memory on the current device, as a flat uint8 tensor.

        Give it back with `free_device_buffer` only once every stream that used it is done (the caller
        waited on their events). On a device this is the caching allocator. On cpu freed blocks are kept
        and handed to the next request they fit (up to twice its size) at once, as the caching allocator does: a
        missing wait before a free then shows up as overwritten data in cpu tests, and steady-state
        steps map no fresh pages.
        """
        if self.module is None:
            return self._memory.blocks.take(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.current_device())

    def free_device_buffer(self, buffer: torch.Tensor) -> None:
        """Return a `device_buffer` for reuse (on a device the caching allocator reclaims it once dropped).

        The caller must have made the compute stream wait for every side stream that used the buffer: the
        allocator hands it to the compute stream at once. On cpu a free while a side-stream task using the
        buffer has not finished raises (a missing wait).
        """
        if self.module is None:
            key = storage_key(buffer)
            users = [stream.name for stream in self._streams.side_streams() if stream.may_use(key)]
            if users:
                raise RuntimeError(
                    f"device buffer freed while {', '.join(users)} may still use it: wait for the stream's event first"
                )
            self._memory.blocks.give_back(buffer)

    def empty_cache(self) -> None:
        """Release cached free device memory (cpu: the blocks `free_device_buffer` kept)."""
        if self.module is None:
            self._memory.blocks.clear()
        else:
            self.module.empty_cache()

    def mark_memory_baseline(self) -> None:
        """Call before building the model. cpu: from here on memory readings count tensor memory only, as
        on a device (see `cpu_memory`); a device's allocator counts that already."""
        if self.module is None:
            self._memory.mark_baseline()

    def memory_allocated(self) -> int:
        """Bytes of tensors on the device now (cpu: `RssAnon` above the baseline; the host tier is excluded)."""
        if self.module is None:
            return self._memory.allocated()
        return int(self.module.memory_allocated())

    def max_memory_allocated(self) -> int:
        """Peak bytes of tensors on the device since the last reset (cpu: the sampled peak of `RssAnon`
        above the baseline)."""
        if self.module is None:
            return self._memory.peak()
        return int(self.module.max_memory_allocated())

    def reset_peak_memory_stats(self) -> None:
        if self.module is None:
            self._memory.reset_peak()
        else:
            self.module.reset_peak_memory_stats()

    def stream(self, delay_s: float = 0.0) -> Stream:
        """A new side stream; on cpu each submitted task first sleeps `delay_s` (test hook for races)."""
        if self.module is None:
            return self._streams.new_stream(delay_s)
        return _DeviceStream(self.module.Stream(), self.module)

    def current_stream(self) -> Stream:
        """The stream the caller's work runs on (cpu: the calling thread, unless inside `use_stream`)."""
        if self.module is None:
            return self._streams.current()
        return _DeviceStream(self.module.current_stream(), self.module)

    def event(self) -> Event:
        """A new event; it counts as complete until first recorded."""
        if self.module is None:
            return _CpuEvent(self._streams)
        return _DeviceEvent(self.module.Event())

    @contextmanager
    def use_stream(self, stream: Stream) -> Iterator[Stream]:
        """Make `stream` current for the block.

        On cpu this only changes the default of `current_stream()`, `Event.record()` and `Event.wait()`:
        plain torch ops in the block still run on the calling thread at once; work goes to a side
        stream only through `stream.submit`.
        """
        with self._streams.using(stream) if self.module is None else self.module.stream(stream.raw):
            yield stream

    @contextmanager
    def check_ordering(self) -> Iterator[Any]:
        """cpu only, for tests: raise `OrderingError` when a side-stream task is submitted before its stream
        waited for the compute work that last touched its memory (see `device_check`)."""
        from internlm_offload.device_check import ComputeLedger

        if self.module is not None:
            raise RuntimeError("check_ordering() checks the cpu emulation; a device orders its streams itself")
        ledger = ComputeLedger()
        self._streams.ledger = ledger
        try:
            with ledger:
                yield ledger
        finally:
            self._streams.ledger = None

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """Tell the caching allocator that `stream` uses `tensor`: its memory is not reused before the
        stream's work queued so far has run (cpu: the stream keeps it alive until it is next idle)."""
        if self.module is not None:
            tensor.record_stream(stream.raw)
        elif isinstance(stream, _CpuStream):
            stream.keep_until_idle(tensor)

    def copy_async(
        self, dst: torch.Tensor | Sequence[torch.Tensor], src: torch.Tensor | Sequence[torch.Tensor], stream: Stream
    ) -> None:
        """`dst.copy_(src)` on `stream`, or pairwise for two sequences (one stream task); the caller orders it with events."""
        if isinstance(dst, torch.Tensor):
            stream.submit(dst.copy_, src, non_blocking=True)
        elif dst:
            stream.submit(_copy_pairs, list(dst), list(src))

    def close_streams(self) -> None:
        """Stop the worker threads this accelerator started on cpu: side streams and the memory sampler."""
        for stream in self._streams.side_streams():
            stream.close()
        self._memory.stop()


def _copy_pairs(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(src, non_blocking=True)


def finish_and_close(*streams: Stream | None) -> None:
    """Wait for the work submitted to each stream, then close it (None is skipped); every stream is closed
    even when one failed, and the first failure (a cpu worker's) is raised after."""
    failure: StreamError | None = None
    for stream in streams:
        if stream is None:
            continue
        try:
            stream.synchronize()
        except StreamError as exc:
            failure = failure or exc
        finally:
            stream.close()
    if failure is not None:
        raise failure


class CopyTimer:
    """Seconds a stream spent running the work handed to `run`, summed.

    Timing on the host around a device copy would time only its enqueue. On cpu the work runs in the
    stream's worker thread and is timed there; on a device a pair of timing events brackets it on the
    stream, and `seconds()` adds the pairs that have completed (it never waits for the others).
    """

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self._seconds = 0.0
        self._pending: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()

    def run(self, stream: Stream, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Submit `fn(*args, **kwargs)` to `stream`, timed."""
        module = self.accelerator.module
        if module is None:
            stream.submit(self._timed, fn, args, kwargs)
            return
        start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
        start.record(stream.raw)
        stream.submit(fn, *args, **kwargs)
        end.record(stream.raw)
        self._pending.append((start, end))

    def seconds(self) -> float:
        """The total so far: every timed piece of work that has finished."""
        still_running = []
        for start, end in self._pending:
            if end.query():
                self._seconds += start.elapsed_time(end) / 1e3  # milliseconds
            else:
                still_running.append((start, end))
        self._pending = still_running
        return self._seconds

    def _timed(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        begin = time.perf_counter()
        fn(*args, **kwargs)
        with self._lock:
            self._seconds += time.perf_counter() - begin


def get_accelerator(name: str = "auto") -> Accelerator:
    """Pick the accelerator: `auto` prefers cuda, then npu, then cpu; a named one must be available."""
    if name == "auto":
        for candidate in ("cuda", "npu"):
            if is_available(candidate):
                return Accelerator(candidate)
        return Accelerator("cpu")
    if not is_available(name):
        raise ValueError(f"device={name!r} is not available on this machine; use 'auto' or 'cpu'")
    return Accelerator(name)


def is_available(name: str) -> bool:
    if name == "cpu":
        return True
    if name == "npu" and importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  registers torch.npu

    module = getattr(torch, name, None)
    return module is not None and module.is_available()


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of `tensor`'s storage while it lives: its views share it, other storages do not.

    Not `data_ptr()`: meta storages (the memory planner's trace) all have a null data pointer.
    """
    return tensor.untyped_storage()._cdata


# ---- cuda / npu: thin wrappers over `torch.<name>.Stream` / `torch.<name>.Event` -----------------


class _DeviceStream(Stream):
    def __init__(self, raw: Any, module: Any) -> None:
        self.raw, self._module = raw, module

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        # Runs now on the host; the kernels fn launches are enqueued on this stream.
        with self._module.stream(self.raw):
            fn(*args, **kwargs)

    def wait_event(self, event: Event) -> None:
        self.raw.wait_event(event.raw)

    def synchronize(self) -> None:
        self.raw.synchronize()

    def _new_event(self) -> Event:
        return _DeviceEvent(self._module.Event())


class _DeviceEvent(Event):
    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def record(self, stream: Stream | None = None) -> None:
        self.raw.record(None if stream is None else stream.raw)

    def wait(self, stream: Stream | None = None) -> None:
        self.raw.wait(None if stream is None else stream.raw)

    def synchronize(self) -> None:
        self.raw.synchronize()

    def query(self) -> bool:
        return bool(self.raw.query())


# ---- cpu: a side stream is a worker thread; the main stream is the calling thread ----------------


class _Mark:
    """One `Event.record`: set when its stream reaches it, carrying the stream's failure if any."""

    __slots__ = ("done", "error")

    def __init__(self, done: bool = False) -> None:
        self.done, self.error = threading.Event(), None
        if done:
            self.done.set()

    def complete(self, error: BaseException | None) -> None:
        self.error = error
        self.done.set()

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class _StreamRegistry:
    """Per-Accelerator cpu stream state: the main pseudo-stream, side streams, each thread's current stream."""

    def __init__(self) -> None:
        self.main = _CpuMainStream(self)
        self._side: weakref.WeakSet[_CpuStream] = weakref.WeakSet()  # a dropped stream may be collected
        self._lock = threading.Lock()
        self._local = _ThreadStreams()
        self._count = 0
        self.ledger: Any = None  # a device_check.ComputeLedger while `check_ordering()` runs

    def __reduce__(self) -> tuple[type, tuple]:
        # Threads and locks do not copy: a copied or unpickled Accelerator starts with no streams.
        return (_StreamRegistry, ())

    def new_stream(self, delay_s: float) -> _CpuStream:
        with self._lock:
            self._count += 1
            stream = _CpuStream(self, f"cpu-stream-{self._count}", delay_s)
            self._side.add(stream)
        return stream

    def side_streams(self) -> list[_CpuStream]:
        with self._lock:
            return [stream for stream in self._side if not stream.closed]

    def current(self) -> Stream:
        return self._local.stack[-1] if self._local.stack else self.main

    @contextmanager
    def using(self, stream: Stream) -> Iterator[None]:
        self._local.stack.append(stream)
        try:
            yield
        finally:
            self._local.stack.pop()


class _ThreadStreams(threading.local):
    """Each thread's stack of `use_stream` blocks."""

    def __init__(self) -> None:
        self.stack: list[Stream] = []


class _CpuEvent(Event):
    def __init__(self, registry: _StreamRegistry) -> None:
        self._registry = registry
        self._mark = _Mark(done=True)  # like CUDA: an event never recorded counts as complete
        self.epoch = 0  # the last compute op this event is ordered after (for `check_ordering`)

    def record(self, stream: Stream | None = None) -> None:
        # A fresh mark per record: waits queued earlier keep the record they saw, as in CUDA.
        mark = _Mark()
        stream = self._registry.current() if stream is None else stream
        stream._enqueue_mark(mark)
        self._mark = mark
        self.epoch = stream._compute_epoch()

    def wait(self, stream: Stream | None = None) -> None:
        (self._registry.current() if stream is None else stream).wait_event(self)

    def synchronize(self) -> None:
        self._mark.wait()

    def query(self) -> bool:
        if not self._mark.done.is_set():
            return False
        self._mark.wait()  # raises when the stream failed before reaching the mark
        return True


class _CpuMainStream(Stream):
    """The calling thread: its work is synchronous, so marks complete at once and waits block now."""

    def __init__(self, registry: _StreamRegistry) -> None:
        self._registry = registry

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        fn(*args, **kwargs)

    def wait_event(self, event: Event) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        pass  # everything submitted to the calling thread has already run

    def _new_event(self) -> Event:
        return _CpuEvent(self._registry)

    def _enqueue_mark(self, mark: _Mark) -> None:
        mark.complete(None)

    def _compute_epoch(self) -> int:
        ledger = self._registry.ledger
        return 0 if ledger is None else ledger.epoch


class _CpuStream(Stream):
    """A side stream: one daemon worker thread, started on first use, runs tasks in FIFO order.

    After a task raises, the stream is poisoned: queued tasks are skipped, queued marks complete with
    the error, and every later call raises a `StreamError` whose `__cause__` is the original exception.
    """

    def __init__(self, registry: _StreamRegistry, name: str, delay_s: float = 0.0) -> None:
        self._registry, self.name, self.delay_s = registry, name, delay_s
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._kept: list[torch.Tensor] = []  # record_stream'ed tensors, released when the stream is idle
        self._waited_epoch = 0  # the last compute op this stream has waited for (`check_ordering`)
        self._pending: Counter[int] = Counter()  # storages of the tasks not yet finished
        self._thread: threading.Thread | None = None
        self.closed = False
        self._failure: BaseException | None = None
        # A forgotten stream stops its worker once collected (queued tasks keep it alive until they ran).
        weakref.finalize(self, self._tasks.put, None)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        tensors = list(_tensors(getattr(fn, "__self__", None), args, kwargs))
        if self._registry.ledger is not None:
            self._registry.ledger.check(self.name, self._waited_epoch, tensors)
        storages = [storage_key(t) for t in tensors]
        with self._lock:
            self._pending.update(storages)
        self._put(partial(self._run_task, fn, args, kwargs, storages))

    def may_use(self, key: int) -> bool:
        """Whether a task not yet finished on this stream uses the storage `key` (`storage_key`)."""
        with self._lock:
            return self._pending[key] > 0

    def keep_until_idle(self, tensor: torch.Tensor) -> None:
        """Hold `tensor` until the stream has run everything queued (what `record_stream` promises)."""
        with self._lock:
            self._kept.append(tensor)

    def wait_event(self, event: Event) -> None:
        # Bind the event's latest record now; a wait on a failed stream's mark poisons this one too.
        self._put(partial(self._guard, event._mark.wait))
        self._waited_epoch = max(self._waited_epoch, event.epoch)

    def _compute_epoch(self) -> int:
        return self._waited_epoch

    def synchronize(self) -> None:
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"a task on {self.name} waits for its own stream: it would never finish")
        with self._lock:
            idle = self._thread is None or self.closed
        if not idle:
            mark = _Mark()
            self._enqueue_mark(mark)
            mark.wait()
        self._raise_if_failed()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            thread = self._thread
        if thread is not None:
            self._tasks.put(None)  # after the tasks already queued
            thread.join()

    @property
    def is_alive(self) -> bool:
        """Whether the worker thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def _new_event(self) -> Event:
        return _CpuEvent(self._registry)

    def _enqueue_mark(self, mark: _Mark) -> None:
        # Marks run even on a poisoned stream, so whoever waits on them wakes up and sees the error.
        self._put(lambda: mark.complete(self._error()), check_failed=False)

    def _put(self, task: Callable[[], None], check_failed: bool = True) -> None:
        with self._lock:
            if self.closed:
                raise RuntimeError(f"{self.name} is closed; create a new one with Accelerator.stream()")
            if check_failed:
                self._raise_if_failed()
            if self._thread is None:
                self._thread = threading.Thread(target=_drain, args=(self._tasks, self._lock, self._kept),
                                                name=self.name, daemon=True)  # fmt: skip
                self._thread.start()
            self._tasks.put(task)

    def _run_task(self, fn: Callable[..., Any], args: tuple, kwargs: dict, storages: list[int]) -> None:
        if self.delay_s and self._failure is None:
            time.sleep(self.delay_s)
        # Inside a task the current stream is this one, as inside `torch.cuda.stream(s)`.
        with self._registry.using(self):
            self._guard(_check_alive, self.name, fn, args, kwargs)
            self._guard(fn, *args, **kwargs)
        with self._lock:
            self._pending.subtract(storages)

    def _guard(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        if self._failure is not None:
            return  # poisoned: skip
        try:
            fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001  kept and re-raised on the host
            self._failure = exc

    def _error(self) -> StreamError | None:
        if self._failure is None:
            return None
        error = StreamError(f"a task on {self.name} failed: {self._failure!r}")
        error.__cause__ = self._failure
        return error

    def _raise_if_failed(self) -> None:
        error = self._error()
        if error is not None:
            raise error


def _drain(tasks: queue.SimpleQueue, lock: threading.Lock, kept: list[torch.Tensor]) -> None:
    """Worker loop of a cpu side stream: run tasks in order until a None arrives; drop `kept` when idle."""
    while True:
        task = tasks.get()
        if task is None:
            return
        task()
        del task  # drop the closure (and the stream it holds) before blocking again
        with lock:  # submitters append under the same lock: nothing queued since the check is dropped
            if tasks.empty():
                kept.clear()


def _check_alive(stream_name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """Raise if a tensor this task uses is held by nothing but the task: the program freed it.

    On a device the caching allocator could already have handed that memory to someone else (the
    task would read or write a stranger's data): the program must keep a reference until the
    stream's event completed, or `record_stream` it.
    """
    orphan = _orphan(fn, args, kwargs)
    if orphan is not None:
        raise RuntimeError(
            f"a tensor ({tuple(orphan.shape)}, {orphan.dtype}) queued on {stream_name} was freed by the program "
            "before the stream used it; keep a reference until the stream's event completes, or record_stream it"
        )


def _orphan(fn: Callable[..., Any], args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A cpu tensor of the task whose storage nothing outside the task refers to, if any.

    A storage is alive when a tensor object the task does not hold points to it (each tensor object
    is one reference to its storage), or when something besides the task refers to one of the task's
    tensor objects (counted with `sys.getrefcount`, less the task's own references and this function's).
    """
    found = list(_tensors(getattr(fn, "__self__", None), args, kwargs))
    occurrences = Counter(map(id, found))
    # A view keeps its base alive: the base counts as held by the task (with no reference of the task's own).
    bases = [t._base for t in found if t._base is not None]
    own = {**{id(t): _OWN_BASE_REFS for t in bases}, **{key: n + _OWN_REFS for key, n in occurrences.items()}}
    unique = {id(t): t for t in found + bases if t.device.type == "cpu" and t.untyped_storage().nbytes()}
    del found, bases
    by_storage: dict[int, list[int]] = {}
    for key in unique:
        by_storage.setdefault(unique[key].untyped_storage().data_ptr(), []).append(key)
    for keys in by_storage.values():
        # +1: the storage object `untyped_storage()` makes for the call
        if torch._C._storage_Use_Count(unique[keys[0]].untyped_storage()._cdata) > 1 + len(keys):
            continue
        if any(sys.getrefcount(unique[key]) > own[key] for key in keys):
            continue
        return unique[keys[0]]
    return None


def _own_refs(base: bool) -> int:
    """References `_orphan` holds to a task tensor, or to the base of a task's view (calibrated once: they
    depend on the interpreter and on torch keeping a view's base wrapper alive)."""
    probe = torch.zeros(2)
    task_args = (probe[:1],) if base else (probe,)
    del probe

    def measure() -> int:  # holds it as `_orphan` does: in a dict, then getrefcount's argument
        held = task_args[0]._base if base else task_args[0]
        unique = {id(held): held}
        del held
        return sys.getrefcount(unique[next(iter(unique))])

    return measure() - (0 if base else 1)  # less the task's own reference (`task_args`)


_OWN_REFS, _OWN_BASE_REFS = _own_refs(base=False), _own_refs(base=True)


def _tensors(*objects: Any) -> Iterator[torch.Tensor]:
    """The tensors among `objects`, one level into tuples, lists and dicts."""
    for obj in objects:
        items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else (obj,)
        for item in items:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list)):
                yield from (t for t in item if isinstance(t, torch.Tensor))


# ---- host buffers: registered pinned memory (cuda); on cpu, files mapped from SHM_DIR ----------------


def aligned_within(raw: torch.Tensor, nbytes: int, alignment: int) -> torch.Tensor:
    """The first `nbytes` of the flat uint8 `raw` that start on a multiple of `alignment` (allocate
    `nbytes + alignment` for them): plain allocations only promise 64-byte alignment."""
    start = -raw.data_ptr() % alignment
    return raw[start : start + nbytes]


def _registered_empty(cudart: Any, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
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


def _shm_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
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


