"""Streams and events: the portable interface every backend implements, and helpers over it.

On cpu, work reaches a side stream only through `Stream.submit`. The copy recipe built on these
(wait for the producer, copy, keep dropped tensors alive, record the event) is `copy_lane.CopyLane`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch


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


def copy_pairs(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], non_blocking: bool = True) -> None:
    """`dst.copy_(src)` for each pair: several copies as one stream task."""
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(src, non_blocking=non_blocking)


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


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of `tensor`'s storage while it lives: its views share it, other storages do not.

    Not `data_ptr()`: meta storages (the memory planner's trace) all have a null data pointer.
    """
    return tensor.untyped_storage()._cdata
