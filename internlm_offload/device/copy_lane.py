"""Copies on a side stream, timed where they run.

`CopyTimer`: the seconds a stream spent on the work handed to it (device timing events, or the cpu
worker's clock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from internlm_offload.device.accelerator import Accelerator
from internlm_offload.device.streams import Stream


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
