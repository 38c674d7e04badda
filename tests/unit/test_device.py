"""Unit tests for internlm_offload.device: the cpu stream/event emulation and the thin device wrappers.

Races are made visible with `Accelerator.stream(delay_s=...)`: a delayed copy that is not waited for
leaves stale data behind. Timing only decides orderings with a wide margin, never a pass on speed.
"""

import copy
import pickle
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from internlm_offload.device import Accelerator, StreamError, get_accelerator
from internlm_offload.device.cpu_memory import host_rss_bytes

DELAY_S = 0.3  # injected copy latency; far above thread wake-up times


@pytest.fixture
def acc() -> Iterator[Accelerator]:
    accelerator = Accelerator("cpu")
    yield accelerator
    accelerator.close_streams()


# ---------------------------------------------------------------- ordering and asynchrony


def test_side_stream_runs_tasks_in_fifo_order(acc: Accelerator) -> None:
    stream, seen = acc.stream(), []
    for i in range(200):
        stream.submit(seen.append, i)
    stream.synchronize()
    assert seen == list(range(200))


def test_submit_returns_before_a_delayed_task_and_synchronize_waits(acc: Accelerator) -> None:
    stream, seen = acc.stream(delay_s=DELAY_S), []
    stream.submit(seen.append, "ran")
    assert seen == []
    stream.synchronize()
    assert seen == ["ran"]


def test_event_after_delayed_copy(acc: Accelerator) -> None:
    stream = acc.stream(delay_s=DELAY_S)
    src, dst = torch.arange(1000.0), torch.zeros(1000)
    acc.copy_async(dst, src, stream)
    done = stream.record_event()
    assert not done.query()
    done.synchronize()
    assert done.query()
    assert torch.equal(dst, src)


@pytest.mark.parametrize("wait", [True, False])
def test_cross_stream_wait_orders_copies(acc: Accelerator, wait: bool) -> None:
    slow, fast = acc.stream(delay_s=DELAY_S), acc.stream()
    src, x, y = torch.full((1000,), 7.0), torch.zeros(1000), torch.zeros(1000)
    acc.copy_async(x, src, slow)  # x <- src, late
    x_ready = slow.record_event()
    if wait:
        fast.wait_event(x_ready)
    acc.copy_async(y, x, fast)  # y <- x
    fast.synchronize()
    # Without the wait the second copy reads x before the first one wrote it: the race is visible.
    assert torch.equal(y, src if wait else torch.zeros(1000))
    slow.synchronize()
    assert torch.equal(x, src)


def test_main_stream_waits_on_event(acc: Accelerator) -> None:
    stream = acc.stream(delay_s=DELAY_S)
    src, dst = torch.arange(10.0), torch.zeros(10)
    acc.copy_async(dst, src, stream)
    done = stream.record_event()
    done.wait()  # default: the current stream, i.e. the calling thread, which blocks now
    assert done.query() and torch.equal(dst, src)


def test_wait_stream_and_accelerator_synchronize(acc: Accelerator) -> None:
    a, b = acc.stream(delay_s=DELAY_S), acc.stream(delay_s=DELAY_S)
    seen: list[str] = []
    a.submit(seen.append, "a")
    acc.current_stream().wait_stream(a)
    assert seen == ["a"]
    b.submit(seen.append, "b")
    acc.synchronize()
    assert seen == ["a", "b"]


def test_side_stream_overlaps_main_thread_matmul(acc: Accelerator) -> None:
    stream, go, stamps = acc.stream(), threading.Event(), {}
    src, dst = torch.randn(8_000_000), torch.empty(8_000_000)

    def timed_copy() -> None:
        go.wait()  # start only once the main thread is about to enter the matmul
        stamps["copy_start"] = time.perf_counter()
        dst.copy_(src)

    stream.submit(timed_copy)
    a = torch.randn(2048, 2048)
    go.set()
    a @ a
    stamps["matmul_end"] = time.perf_counter()
    stream.synchronize()
    # Only possible when the matmul released the GIL while the worker thread ran.
    assert stamps["copy_start"] < stamps["matmul_end"]
    assert torch.equal(dst, src)


# ---------------------------------------------------------------- events and current stream


def test_event_never_recorded_is_complete_and_rerecord_resets(acc: Accelerator) -> None:
    stream, event = acc.stream(delay_s=DELAY_S), acc.event()
    assert event.query()
    event.synchronize()
    event.record(stream)
    assert not event.query()
    event.synchronize()
    assert event.query()
    event.record(stream)  # now refers to the newest record
    assert not event.query()
    event.synchronize()


def test_event_recorded_on_main_stream_is_complete_at_once(acc: Accelerator) -> None:
    event = acc.event()
    event.record()
    assert event.query()


def test_current_stream_is_per_instance_and_use_stream_changes_it(acc: Accelerator) -> None:
    main, side, other = acc.current_stream(), acc.stream(delay_s=DELAY_S), Accelerator("cpu")
    assert acc.current_stream() is main
    assert other.current_stream() is not main
    assert acc == other and hash(acc) == hash(other)  # stream state is not part of identity
    seen = []
    with acc.use_stream(side):
        assert acc.current_stream() is side
        side.submit(lambda: seen.append(acc.current_stream()))
        done = acc.event()
        done.record()  # default stream inside the block: the side stream
        assert not done.query()
    assert acc.current_stream() is main
    done.synchronize()
    assert seen == [side]  # inside a task the current stream is the task's stream


def test_accelerator_copies_without_its_streams(acc: Accelerator) -> None:
    acc.stream().submit(int)
    for clone in (copy.deepcopy(acc), pickle.loads(pickle.dumps(acc))):
        assert clone == acc
        assert clone.current_stream() is not acc.current_stream()


# ---------------------------------------------------------------- failures and lifecycle


def test_task_exception_surfaces_on_synchronize_and_poisons_the_stream(acc: Accelerator) -> None:
    stream, seen = acc.stream(), []

    def boom() -> None:
        raise ValueError("bad copy")

    stream.submit(boom)
    stream.submit(seen.append, "skipped")
    with pytest.raises(RuntimeError, match="cpu-stream-1") as info:
        stream.synchronize()
    assert isinstance(info.value, StreamError)
    assert isinstance(info.value.__cause__, ValueError)
    assert seen == []
    with pytest.raises(StreamError):
        stream.submit(seen.append, "later")
    with pytest.raises(StreamError):
        stream.synchronize()


def test_task_exception_reaches_event_waiters(acc: Accelerator) -> None:
    failing, waiting = acc.stream(delay_s=0.05), acc.stream()
    failing.submit(lambda: 1 / 0)
    done = failing.record_event()
    waiting.wait_event(done)
    with pytest.raises(StreamError) as info:
        done.synchronize()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    with pytest.raises(StreamError):
        acc.current_stream().wait_event(done)
    with pytest.raises(StreamError, match="cpu-stream-2") as info:
        waiting.synchronize()  # the dependent stream is poisoned too; the chain leads to the original
    assert isinstance(info.value.__cause__.__cause__, ZeroDivisionError)


def test_close_stops_worker_and_rejects_submit(acc: Accelerator) -> None:
    stream, seen = acc.stream(delay_s=0.05), []
    stream.submit(seen.append, 1)
    assert stream.is_alive
    stream.close()  # runs what was queued, then stops
    assert seen == [1] and not stream.is_alive
    stream.close()
    with pytest.raises(RuntimeError, match="closed"):
        stream.submit(seen.append, 2)


def test_close_streams_closes_every_side_stream(acc: Accelerator) -> None:
    streams = [acc.stream() for _ in range(3)]
    for stream in streams:
        stream.submit(int)
    acc.close_streams()
    assert not any(stream.is_alive for stream in streams)
    acc.synchronize()  # closed streams are skipped


def test_worker_threads_are_daemons(acc: Accelerator) -> None:
    stream = acc.stream()
    stream.submit(int)
    workers = [thread for thread in threading.enumerate() if thread.name == stream.name]
    assert workers and all(thread.daemon for thread in workers)


# ---------------------------------------------------------------- memory and host buffers


def test_host_empty_falls_back_to_pageable_on_cpu() -> None:
    buf = Accelerator("cpu").host_empty((4, 8), torch.bfloat16, pinned=True)
    assert buf.shape == (4, 8) and buf.dtype == torch.bfloat16 and not buf.is_pinned()


def test_memory_stats_on_cpu() -> None:
    acc = get_accelerator("cpu")
    for value in (acc.memory_allocated(), acc.max_memory_allocated(), host_rss_bytes()):
        assert isinstance(value, int) and value > 0
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() > 0
    assert acc.record_stream(torch.zeros(1), acc.current_stream()) is None  # no-op on cpu


# ---------------------------------------------------------------- cuda/npu wrappers against a fake module


class _FakeRaw:
    def __init__(self, log: list, kind: str) -> None:
        self.log, self.kind = log, kind

    def __getattr__(self, name: str):
        return lambda *args: self.log.append((self.kind, name, *args))


def _fake_module(log: list) -> SimpleNamespace:
    @contextmanager
    def stream(raw: _FakeRaw) -> Iterator[None]:
        log.append(("enter", raw))
        yield
        log.append(("exit", raw))

    return SimpleNamespace(
        Stream=lambda: _FakeRaw(log, "stream"),
        Event=lambda: _FakeRaw(log, "event"),
        current_stream=lambda: _FakeRaw(log, "current"),
        stream=stream,
    )


def test_device_wrappers_forward_to_the_torch_module(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list = []
    monkeypatch.setattr(torch, "fakedev", _fake_module(log), raising=False)
    acc = Accelerator("fakedev")
    side, event = acc.stream(delay_s=5.0), acc.event()  # the delay is a cpu-only hook
    side.submit(log.append, "work")
    assert log == [("enter", side.raw), "work", ("exit", side.raw)]
    log.clear()
    event.record(side)
    side.wait_event(event)
    event.wait()
    event.synchronize()
    side.synchronize()
    assert log == [
        ("event", "record", side.raw),
        ("stream", "wait_event", event.raw),
        ("event", "wait", None),
        ("event", "synchronize"),
        ("stream", "synchronize"),
    ]
    log.clear()
    with acc.use_stream(side) as current:
        assert current is side
    assert log == [("enter", side.raw), ("exit", side.raw)]


def test_the_memory_baseline_starts_the_peak_on_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda/npu: readings after `mark_memory_baseline` count from it, the peak included (a step run before the
    build, as the runtime probe's, is not the build's peak)."""
    allocated, peak = [300], [900]
    fake = SimpleNamespace(
        memory_allocated=lambda: allocated[0],
        max_memory_allocated=lambda: peak[0],
        reset_peak_memory_stats=lambda: peak.__setitem__(0, allocated[0]),
    )
    monkeypatch.setattr(torch, "fakedev", fake, raising=False)
    acc = Accelerator("fakedev")
    acc.mark_memory_baseline()
    allocated[0], peak[0] = 350, max(peak[0], 420)
    assert (acc.memory_allocated(), acc.max_memory_allocated()) == (50, 120)


def test_accelerator_names_are_checked_and_npu_imports_torch_npu_itself():
    import importlib.util

    with pytest.raises(ValueError, match=r"Accelerator\('tpu'\): torch has no 'tpu' device module"):
        Accelerator("tpu")
    if importlib.util.find_spec("torch_npu") is None:  # this machine: a clear error instead of AttributeError
        with pytest.raises(ValueError, match="needs torch_npu"):
            Accelerator("npu")


def test_copy_mode_auto_is_async_except_on_npu():
    from internlm_offload.offload.activation import copy_mode

    assert [copy_mode("auto", d) for d in ("cuda", "cpu", "npu")] == ["async", "async", "sync"]
    assert copy_mode("async", "npu") == "async" and copy_mode("sync", "cuda") == "sync"


class _TimingEvent:
    """A device timing event on a fake clock: `record` stamps the device time."""

    def __init__(self, clock: SimpleNamespace, enable_timing: bool = False) -> None:
        self.clock, self.stamp, self.done = clock, None, True

    def record(self, raw: object = None) -> None:
        self.stamp, self.done = self.clock.now, self.clock.complete

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "_TimingEvent") -> float:
        return (end.stamp - self.stamp) * 1e3  # milliseconds, as torch.cuda.Event.elapsed_time


def test_copy_timer_reads_device_time_and_never_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    from internlm_offload.device import CopyTimer

    clock = SimpleNamespace(now=0.0, complete=True)
    fake = SimpleNamespace(
        Stream=object,
        Event=lambda enable_timing=False: _TimingEvent(clock, enable_timing),
        current_stream=object,
        stream=lambda raw: contextmanager(lambda: iter([None]))(),
    )
    monkeypatch.setattr(torch, "fakedev", fake, raising=False)
    timer, side = CopyTimer(Accelerator("fakedev")), Accelerator("fakedev").stream()

    def copy() -> None:  # enqueued at once on the host; the device clock says it took 2.5 s
        clock.now += 2.5

    timer.run(side, copy)
    assert timer.seconds() == 2.5
    clock.complete = False
    timer.run(side, copy)
    assert timer.seconds() == 2.5  # still running: not counted, not waited for
    timer._pending[0][1].done = True
    assert timer.seconds() == 5.0


def test_copy_timer_on_cpu_times_the_work_in_the_worker() -> None:
    from internlm_offload.device import CopyTimer

    acc = Accelerator("cpu")
    timer, side = CopyTimer(acc), acc.stream()
    timer.run(side, time.sleep, 0.05)
    side.synchronize()
    assert 0.05 <= timer.seconds() < 1.0
    side.close()


# ---------------------------------------------------------------- freed-before-use checker


def _copy_from_a_dropped_source(acc: Accelerator, stream, dst: torch.Tensor, *, view: bool, record: bool) -> None:
    src = torch.randn(1000)
    acc.copy_async(dst[:500] if view else dst, src[:500] if view else src, stream)
    if record:
        acc.record_stream(src, stream)  # the promise a device program makes instead of keeping `src`


@pytest.mark.parametrize("view", [False, True])
def test_a_copy_whose_source_was_freed_raises(view: bool) -> None:
    acc = Accelerator("cpu")
    stream, dst = acc.stream(delay_s=0.02), torch.empty(1000)
    _copy_from_a_dropped_source(acc, stream, dst, view=view, record=False)
    with pytest.raises(StreamError, match="freed by the program before the stream used it"):
        stream.synchronize()
    acc.close_streams()


@pytest.mark.parametrize("view", [False, True])
def test_a_kept_or_recorded_source_is_fine(view: bool) -> None:
    acc = Accelerator("cpu")
    stream, dst = acc.stream(delay_s=0.02), torch.empty(1000)
    _copy_from_a_dropped_source(acc, stream, dst, view=view, record=True)
    src = torch.randn(1000)
    acc.copy_async([dst[:10], dst[10:20]], [src[:10], src[10:20]], stream)  # kept by the caller
    stream.synchronize()
    assert torch.equal(dst[10:20], src[10:20])
    assert stream._kept == []  # record_stream's hold ends once the stream is idle
    acc.close_streams()


def test_large_pinned_buffers_are_registered_at_their_exact_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda: big pinned buffers are page-aligned ordinary memory, registered once and unregistered with
    their storage, instead of the caching host allocator's power-of-two blocks."""
    import gc

    import internlm_offload.device.host_alloc as device_mod

    calls: list = []
    cudart = SimpleNamespace(
        cudaHostRegister=lambda ptr, size, flags: calls.append(("register", ptr, size)) or 0,
        cudaHostUnregister=lambda ptr: calls.append(("unregister", ptr)) or 0,
    )
    fake = SimpleNamespace(cudart=lambda: cudart)
    monkeypatch.setattr(torch, "fakedev", fake, raising=False)
    acc = Accelerator("fakedev")
    nbytes = device_mod.REGISTER_MIN_BYTES + 12  # not a power of two, not a page multiple
    host = acc.host_empty((nbytes // 4,), torch.float32)
    ((kind, ptr, size),) = calls
    assert kind == "register" and ptr == host.data_ptr() and ptr % device_mod.PAGE_BYTES == 0
    assert nbytes <= size < nbytes + device_mod.PAGE_BYTES  # pinned bytes ~ logical bytes, not 2x
    host.fill_(1.0)
    view = host[5:]
    del host
    gc.collect()
    assert len(calls) == 1, "unregistered while a view still uses the memory"
    del view
    gc.collect()
    assert calls[-1] == ("unregister", ptr)


def test_finish_and_close_raises_what_the_stream_left_behind() -> None:
    """Closing waits for the queued work and reports its failure, instead of dropping it with the thread."""
    from internlm_offload.device import finish_and_close

    acc = Accelerator("cpu")
    stream, other = acc.stream(delay_s=0.02), acc.stream()
    done: list[int] = []
    stream.submit(done.append, 1)
    stream.submit(lambda: 1 / 0)
    other.submit(done.append, 2)
    with pytest.raises(StreamError, match="ZeroDivisionError"):
        finish_and_close(stream, None, other)
    assert sorted(done) == [1, 2]
    assert all(s.closed and not s.is_alive for s in (stream, other))  # both threads stopped despite the failure


def test_offloaders_take_the_accelerator_of_their_tensors_not_of_the_machine(monkeypatch):
    """On a machine with a GPU, a model built on the host is offloaded by the cpu emulation: with the machine's
    accelerator (cuda) its host tensors would count as offloaded already and nothing would move."""
    from internlm_offload.device import accelerator as accelerator_module
    from internlm_offload.device import accelerator_for
    from internlm_offload.offload.activation import ActivationOffloader
    from internlm_offload.optim.hybrid import HybridDeviceOptimizer
    from internlm_offload.optim.swap import SwapAdamW

    monkeypatch.setattr(accelerator_module, "is_available", lambda name: True)  # as on a machine with cuda
    assert get_accelerator().name == "cuda" and accelerator_for([]).name == "cuda"
    layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    assert accelerator_for([torch.empty(1, device="meta")]).name == "cpu"
    assert ActivationOffloader(layers, 1).accelerator.name == "cpu"
    assert SwapAdamW(layers.parameters()).accelerator.name == "cpu"
    assert HybridDeviceOptimizer(layers.parameters(), offload_fraction=0.5)._acc.name == "cpu"
