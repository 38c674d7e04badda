"""The copy engine of the activation offloaders: device tensors to pooled host buffers and back.

Both offloaders (`activation.ActivationOffloader`, `selective_offload.SelectiveOffloader`) decide *what*
goes to the host and *when*; this module does the moving, the same way for both:
- `mode="async"`: D2H copies on a `d2h` side stream, H2D copies on an `h2d` side stream, each ordered
  after the compute stream's work so far; `reload` returns the event the compute stream waits on (`wait`)
  before it uses the copies.
- `mode="sync"`: the copies run in the calling thread on the compute stream; there is nothing to wait for.
Every device tensor an offloader moves passes through `to_host` or `reload`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from internlm_offload.device import Accelerator, CopyTimer, Event, HostPool, Stream, finish_and_close

# (destination, source): a host buffer and the device tensor it receives, or the reverse for a reload.
CopyPair = tuple[torch.Tensor, torch.Tensor]


class HostCopies:
    """Pooled host buffers, the d2h/h2d streams (None when synchronous) and the seconds copies and waits took."""

    def __init__(self, accelerator: Accelerator, *, asynchronous: bool, pin_memory: bool) -> None:
        self.accelerator = accelerator
        self.pool = HostPool(accelerator, pin_memory)
        # A copy to or from pageable host memory with non_blocking=True blocks the host on cuda: only a
        # pinned buffer makes the copy truly asynchronous.
        self.non_blocking = pin_memory and accelerator.supports_pinned_memory
        self.d2h: Stream | None = accelerator.stream() if asynchronous else None
        self.h2d: Stream | None = accelerator.stream() if asynchronous else None
        self._d2h_timer, self._h2d_timer = CopyTimer(accelerator), CopyTimer(accelerator)  # async copies
        self._timer_base = (0.0, 0.0)
        self._sync_d2h_s = self._sync_h2d_s = self._wait_s = 0.0

    def to_host(self, copies: Iterable[CopyPair]) -> None:
        """Copy each (host buffer, device tensor) out: on the d2h stream after the compute stream's work so far,
        or in the caller, timed. `copies` is consumed in order, after that wait."""
        if self.d2h is None:
            for dst, src in copies:
                start = time.perf_counter()
                dst.copy_(src)
                self._sync_d2h_s += time.perf_counter() - start
            return
        # The copy stream must see the tensors as they are now on the compute stream.
        self.d2h.wait_stream(self.accelerator.current_stream())
        for dst, src in copies:
            self._d2h_timer.run(self.d2h, self._copy, dst, src)

    def reload(self, copies: list[CopyPair]) -> Event | None:
        """Copy each (device buffer, host buffer) back; returns the event to `wait` on before use (None: sync).

        The device buffers must have been allocated on the compute stream, so the caching allocator orders
        their reuse after this point.
        """
        if self.h2d is None:
            start = time.perf_counter()
            for dst, src in copies:
                dst.copy_(src)
            self._sync_h2d_s += time.perf_counter() - start
            return None
        self.h2d.wait_stream(self.accelerator.current_stream())
        for dst, src in copies:
            self._h2d_timer.run(self.h2d, self._copy, dst, src)
            # The reload may never be consumed (a partial backward): the allocator must not reuse the destination
            # while the copy still writes it, even if the compute stream never waits on this event.
            self.accelerator.record_stream(dst, self.h2d)
        return self.h2d.record_event()

    def wait(self, event: Event) -> None:
        """The compute stream waits for `event` (on cpu this blocks the caller); the wait is timed."""
        start = time.perf_counter()
        event.wait()
        self._wait_s += time.perf_counter() - start

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=self.non_blocking)

    # ------------------------------------------------------------------ figures and teardown

    def figures(self) -> dict[str, float]:
        """Copy and wait seconds since the last `reset_figures` (async copies: their own time on their streams,
        not their enqueue)."""
        d2h_s, h2d_s = self._sync_d2h_s, self._sync_h2d_s
        if self.d2h is not None:
            d2h_s = self._d2h_timer.seconds() - self._timer_base[0]
            h2d_s = self._h2d_timer.seconds() - self._timer_base[1]
        return {"d2h_s": d2h_s, "h2d_s": h2d_s, "wait_s": self._wait_s}

    def reset_figures(self) -> None:
        """Count copy and wait seconds from now on."""
        self._sync_d2h_s = self._sync_h2d_s = self._wait_s = 0.0
        self._timer_base = (self._d2h_timer.seconds(), self._h2d_timer.seconds())

    def close(self) -> None:
        """Finish and stop the copy streams and drop the pooled host buffers."""
        finish_and_close(self.d2h, self.h2d)
        self.pool.clear()
