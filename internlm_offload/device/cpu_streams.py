"""The cpu backend: side streams as worker threads, memory readings from the kernel, strict checks.

A side stream is a worker thread with a FIFO queue: copies submitted to it really run beside the main
thread (torch releases the GIL), so a missing wait shows up as wrong data in cpu tests. The main stream
is the calling thread, whose work is synchronous. An event is a mark in a queue; waiting on it blocks
the host (main stream) or queues a wait (side stream). Before each task runs, the freed-tensor check of
`cpu_checks` runs; under `check_ordering()` every submission is checked against the ordering ledger.

"Device memory" is the process's anonymous resident memory (`cpu_memory`); host buffers live in
/dev/shm files (`host_alloc`), so moving data to the host shows up as a drop, as on a GPU.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from internlm_offload.device.cpu_checks import ComputeLedger, check_alive, task_tensors
from internlm_offload.device.cpu_memory import CpuMemory
from internlm_offload.device.host_alloc import shm_empty
from internlm_offload.device.streams import Event, Stream, StreamError, storage_key


class CpuBackend:
    """What `Accelerator("cpu")` does: the stream emulation and the memory readings of this process."""

    def __init__(self, streams: StreamRegistry, memory: CpuMemory) -> None:
        self.streams, self.memory = streams, memory

    def synchronize(self) -> None:
        for stream in self.streams.side_streams():
            stream.synchronize()

    def set_device(self, local_rank: int) -> None:
        pass

    def manual_seed_all(self, seed: int) -> None:
        pass  # torch.manual_seed already seeds the cpu generator

    def rng_state(self) -> torch.Tensor | None:
        return None

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        pass

    def host_empty(self, shape: torch.Size, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        return shm_empty(shape, dtype)  # nothing to pin without a driver; shared memory is the host tier

    def device_memory_bytes(self, local_rank: int) -> int | None:
        return None  # "device" memory is the host's

    def device_count(self) -> int:
        return 0

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return self.memory.blocks.take(nbytes)

    def free_device_buffer(self, buffer: torch.Tensor) -> None:
        key = storage_key(buffer)
        users = [stream.name for stream in self.streams.side_streams() if stream.may_use(key)]
        if users:
            raise RuntimeError(
                f"device buffer freed while {', '.join(users)} may still use it: wait for the stream's event first"
            )
        self.memory.blocks.give_back(buffer)

    def empty_cache(self) -> None:
        self.memory.blocks.clear()

    def device_memory_in_use(self) -> int:
        return 0  # the host's memory: what this process holds is already not available

    def memory_kept_by(self, probe: Callable[[], None]) -> int:
        before = self.memory.reading()
        probe()
        return max(0, self.memory.reading() - before)

    def mark_memory_baseline(self) -> None:
        self.memory.mark_baseline()

    def memory_allocated(self) -> int:
        return self.memory.allocated()

    def max_memory_allocated(self) -> int:
        return self.memory.peak()

    def reset_peak_memory_stats(self) -> None:
        self.memory.reset_peak()

    def stream(self, delay_s: float) -> Stream:
        return self.streams.new_stream(delay_s)

    def current_stream(self) -> Stream:
        return self.streams.current()

    def event(self) -> Event:
        return _CpuEvent(self.streams)

    def use_stream(self, stream: Stream) -> contextlib.AbstractContextManager:
        return self.streams.using(stream)

    @contextmanager
    def check_ordering(self) -> Iterator[ComputeLedger]:
        ledger = ComputeLedger()
        self.streams.ledger = ledger
        try:
            with ledger:
                yield ledger
        finally:
            self.streams.ledger = None

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        if isinstance(stream, _CpuStream):
            stream.keep_until_idle(tensor)

    def close_streams(self) -> None:
        for stream in self.streams.side_streams():
            stream.close()
        self.memory.stop()


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


class StreamRegistry:
    """Per-Accelerator cpu stream state: the main pseudo-stream, side streams, each thread's current stream."""

    def __init__(self) -> None:
        self.main = _CpuMainStream(self)
        self._side: weakref.WeakSet[_CpuStream] = weakref.WeakSet()  # a dropped stream may be collected
        self._lock = threading.Lock()
        self._local = _ThreadStreams()
        self._count = 0
        self.ledger: ComputeLedger | None = None  # a ComputeLedger while `check_ordering()` runs

    def __reduce__(self) -> tuple[type, tuple]:
        # Threads and locks do not copy: a copied or unpickled Accelerator starts with no streams.
        return (StreamRegistry, ())

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
    def __init__(self, registry: StreamRegistry) -> None:
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

    def __init__(self, registry: StreamRegistry) -> None:
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

    def __init__(self, registry: StreamRegistry, name: str, delay_s: float = 0.0) -> None:
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
        tensors = list(task_tensors(getattr(fn, "__self__", None), args, kwargs))
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
                self._thread = threading.Thread(
                    target=_drain, args=(self._tasks, self._lock, self._kept), name=self.name, daemon=True
                )
                self._thread.start()
            self._tasks.put(task)

    def _run_task(self, fn: Callable[..., Any], args: tuple, kwargs: dict, storages: list[int]) -> None:
        if self.delay_s and self._failure is None:
            time.sleep(self.delay_s)
        # Inside a task the current stream is this one, as inside `torch.cuda.stream(s)`.
        with self._registry.using(self):
            self._guard(check_alive, self.name, fn, args, kwargs)
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
