"""The copy recipe every offload path shares: `CopyLane`, one side stream's copies, timed by `CopyTimer`.

An asynchronous copy on a device is correct only with all of:
1. the copy stream waits for the stream that produced the data (the compute stream, as a rule): the source
   is written and the destination no longer read or written there;
2. the copy runs on the copy stream;
3. a tensor the program drops before the copy ran is recorded on the copy stream (`record_stream`), or
   the caching allocator hands its memory out while the copy still reads or writes it;
4. an event recorded after the copy is what the consumer waits on before it uses or reuses either side.
The cpu backend checks 1 and 3 (`cpu_checks`): a missing wait raises `OrderingError` under
`Accelerator.check_ordering()`, a freed tensor fails the stream's task. `CopyLane.copy` does all four;
the activation offloaders (`offload.host_copies`), the swap and hybrid optimizers (and with them the
NVMe tier's files) and gradient offload copy through it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from internlm_offload.device.accelerator import Accelerator
from internlm_offload.device.streams import Event, Stream, copy_pairs

Tensors = torch.Tensor | Sequence[torch.Tensor]


class CopyLane:
    """Copies on one side stream (or, when not asynchronous, in the caller), timed; see the module docstring.

    `stream` is None for a synchronous lane: its copies run at once on the compute stream. `non_blocking`:
    whether the copies may return before they ran (only a pinned host side makes them asynchronous on a
    device). `delay_s`: the cpu stream's injected latency (a test hook, `Accelerator.stream`).
    """

    def __init__(
        self, accelerator: Accelerator, *, asynchronous: bool = True, non_blocking: bool = True, delay_s: float = 0.0
    ) -> None:
        self.accelerator = accelerator
        self.stream: Stream | None = accelerator.stream(delay_s) if asynchronous else None
        self.non_blocking = non_blocking
        self._timer = CopyTimer(accelerator)
        self._sync_seconds = 0.0

    def copy(
        self,
        dst: Tensors,
        src: Tensors,
        *,
        after: Stream | Event | None = None,
        keep_alive: Sequence[torch.Tensor] = (),
    ) -> Event | None:
        """`dst.copy_(src)`, pairwise for two sequences (one stream task), once `after` (default: the current
        stream) has run its work so far. `keep_alive`: tensors the caller may drop before the copy ran.

        Returns the event marking the copy's end, to wait on before using or reusing either side (None when
        synchronous: the copy has run).
        """
        dsts, srcs = _listed(dst), _listed(src)
        if self.stream is None:
            start = time.perf_counter()
            copy_pairs(dsts, srcs, non_blocking=False)
            self._sync_seconds += time.perf_counter() - start
            return None
        self._wait_for(self.accelerator.current_stream() if after is None else after)
        if dsts:
            self._timer.run(self.stream, copy_pairs, dsts, srcs, non_blocking=self.non_blocking)
        for tensor in keep_alive:
            self.accelerator.record_stream(tensor, self.stream)
        return self.stream.record_event()

    def seconds(self) -> float:
        """Seconds the lane's copies took so far: on their stream (those that finished), or in the caller."""
        return self._sync_seconds + self._timer.seconds()

    def _wait_for(self, producer: Stream | Event) -> None:
        """Later copies on the lane start only after `producer`'s work so far (an event: up to its record)."""
        if isinstance(producer, Event):
            self.stream.wait_event(producer)
        else:
            self.stream.wait_stream(producer)


def _listed(tensors: Tensors) -> list[torch.Tensor]:
    # A list of our own: the stream task holds its tensors, whatever the caller does with its sequence.
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


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
            # `args` stay the task's own arguments: the cpu checks look at the tensors among them.
            stream.submit(self._timed, fn, *args, **kwargs)
            return
        start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
        start.record(stream.raw)
        stream.submit(fn, *args, **kwargs)
        end.record(stream.raw)
        self._pending.append((start, end))
        # Owners that never read `seconds()` must not pile up event pairs: fold the finished ones in now.
        while self._pending and self._pending[0][1].query():
            self._fold(self._pending.pop(0))

    def seconds(self) -> float:
        """The total so far: every timed piece of work that has finished."""
        still_running = []
        for pair in self._pending:
            if pair[1].query():
                self._fold(pair)
            else:
                still_running.append(pair)
        self._pending = still_running
        return self._seconds

    def _fold(self, pair: tuple[Any, Any]) -> None:
        start, end = pair
        self._seconds += start.elapsed_time(end) / 1e3  # milliseconds

    def _timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        begin = time.perf_counter()
        fn(*args, **kwargs)
        with self._lock:
            self._seconds += time.perf_counter() - begin
