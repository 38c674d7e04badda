"""The copy engine of the activation offloaders: device tensors to pooled host buffers and back.

Both offloaders (`activation.ActivationOffloader`, `selective_offload.SelectiveOffloader`) decide *what*
goes to the host and *when*; this module does the moving, the same way for both, through two copy lanes
(`device.CopyLane`):
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

from internlm_offload.device import Accelerator, CopyLane, Event, HostPool, Stream, finish_and_close

# (destination, source): a host buffer and the device tensor it receives, or the reverse for a reload.
CopyPair = tuple[torch.Tensor, torch.Tensor]


class HostCopies:
    """Pooled host buffers, the d2h/h2d lanes (their streams None when synchronous) and the seconds copies and
    waits took."""

    def __init__(self, accelerator: Accelerator, *, asynchronous: bool, pin_memory: bool) -> None:
        self.accelerator = accelerator
        self.pool = HostPool(accelerator, pin_memory)
        # A copy to or from pageable host memory with non_blocking=True blocks the host on cuda: only a
        # pinned buffer makes the copy truly asynchronous.
        self.non_blocking = pin_memory and accelerator.supports_pinned_memory
        lane = {"asynchronous": asynchronous, "non_blocking": self.non_blocking}
        self.d2h_lane, self.h2d_lane = CopyLane(accelerator, **lane), CopyLane(accelerator, **lane)
        self._seconds_base = (0.0, 0.0)
        self._wait_s = 0.0

    @property
    def d2h(self) -> Stream | None:
        """The stream copies to the host run on (None: synchronous)."""
        return self.d2h_lane.stream

    @property
    def h2d(self) -> Stream | None:
        """The stream copies back run on (None: synchronous)."""
        return self.h2d_lane.stream

    def to_host(self, copies: Iterable[CopyPair]) -> None:
        """Copy each (host buffer, device tensor) out, after the compute stream's work so far. `copies` is taken
        whole before the copy stream's wait."""
        pairs = list(copies)
        self.d2h_lane.copy([dst for dst, _ in pairs], [src for _, src in pairs])

    def reload(self, copies: list[CopyPair]) -> Event | None:
        """Copy each (device buffer, host buffer) back; returns the event to `wait` on before use (None: sync).

        The device buffers must have been allocated on the compute stream, so the caching allocator orders
        their reuse after this point.
        """
        dsts = [dst for dst, _ in copies]
        # The reload may never be consumed (a partial backward): the allocator must not reuse the destination
        # while the copy still writes it, even if the compute stream never waits on this event.
        return self.h2d_lane.copy(dsts, [src for _, src in copies], keep_alive=dsts)

    def wait(self, event: Event) -> None:
        """The compute stream waits for `event` (on cpu this blocks the caller); the wait is timed."""
        start = time.perf_counter()
        event.wait()
        self._wait_s += time.perf_counter() - start

    # ------------------------------------------------------------------ figures and teardown

    def figures(self) -> dict[str, float]:
        """Copy and wait seconds since the last `reset_figures` (async copies: their own time on their streams,
        not their enqueue)."""
        d2h_s, h2d_s = (lane.seconds() - base for lane, base in zip(self._lanes(), self._seconds_base))
        return {"d2h_s": d2h_s, "h2d_s": h2d_s, "wait_s": self._wait_s}

    def reset_figures(self) -> None:
        """Count copy and wait seconds from now on."""
        self._seconds_base = tuple(lane.seconds() for lane in self._lanes())
        self._wait_s = 0.0

    def close(self) -> None:
        """Finish and stop the copy streams and drop the pooled host buffers."""
        finish_and_close(self.d2h, self.h2d)
        self.pool.clear()

    def _lanes(self) -> tuple[CopyLane, CopyLane]:
        return self.d2h_lane, self.h2d_lane
