"""Selective checkpointing whose kept tensors live on the host (`selective_checkpoint_offload=True`).

Selective checkpointing keeps the outputs of the expensive ops (matmuls, attention) and recomputes
the cheap ones. Here the kept outputs do not stay on the device either: in forward each one is
copied to a pooled host buffer (on a side stream when `mode="async"`); when backward recomputes the
block, the expensive ops are not run again but answered with their outputs brought back from the
host. The device then holds nothing of the block between its forward and its backward except what
checkpointing itself keeps (the block's inputs).

It is built from two dispatch modes handed to `torch.utils.checkpoint` as its `context_fn`: one that
records the expensive outputs during forward, one that replays them during the recompute. Both sit
below autograd, so the recomputed graph is the same graph; the replayed values are the recorded bytes,
so gradients are bitwise those of no checkpointing.

The async schedule is the activation offloader's: a block's device outputs are released at the end of
the *next* selectively offloaded block (their copies had a whole block to finish, double buffering);
when backward replays a block, the copies back of that block and of the one below it start at once
on a second side stream, so the next block's reload overlaps this block's recompute and backward.
Host buffers come from a pool and are reused from the second step on.

Memory saved vs time paid: like selective checkpointing, plus the kept matmul/attention outputs
(for this model family roughly `(6 + 4 * mlp_ratio) * B * T * C` values per block) leave the device,
at the price of one D2H and one H2D copy of them; async holds one extra block's outputs in forward
(the previous block's, until its copies finished) and in backward (the prefetched block's).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from internlm_offload.device import Accelerator, CopyTimer, Event, HostPool, PendingCopy, Stream, finish_and_close
from internlm_offload.log import get_logger
from internlm_offload.offload.checkpointing import expensive_ops

logger = get_logger(__name__)


@dataclass
class SelectiveOffloadStats:
    """Bytes of kept outputs sent to the host and copy/wait times, cumulative over the run."""

    offloaded_bytes: int = 0
    d2h_s: float = 0.0
    h2d_s: float = 0.0
    wait_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"offloaded_bytes": self.offloaded_bytes, "d2h_s": self.d2h_s, "h2d_s": self.h2d_s,
                "wait_s": self.wait_s}  # fmt: skip


@dataclass
class _Recorded:
    """One recorded output tensor on its way to and from the host."""

    host: torch.Tensor  # a view of a pooled buffer, with the output's shape and dtype
    source: torch.Tensor | None  # the device tensor, held until the copy-out finished
    version: int
    device: torch.device
    loaded: torch.Tensor | None = None  # the device copy a replay hands to the recompute


@dataclass
class _Entry:
    """The outputs of one recorded op (None for non-tensor outputs) and their pytree structure."""

    outputs: list[_Recorded | None]
    structure: Any


@dataclass
class _BlockCache:
    """The recorded outputs of one block call, in op order."""

    # The block recorded just before this one in the same forward: backward replays it next. A downward
    # reference only, so caches never form a cycle and die with autograd's graph.
    below: _BlockCache | None = None
    entries: list[_Entry] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)  # pooled host buffers, returned when the cache dies
    pending: PendingCopy = field(default_factory=PendingCopy)  # shared with that finalizer
    copied_out: Event | None = None
    load_started: bool = False
    loaded: Event | None = None
    replay_index: int = 0

    def recorded(self) -> list[_Recorded]:
        return [r for entry in self.entries for r in entry.outputs if r is not None]


class SelectiveOffloader:
    """Moves recorded outputs to host and back, on the accelerator's streams; `stats` counts what it did."""

    def __init__(self, accelerator: Accelerator, mode: str, stats: SelectiveOffloadStats, pin_memory: bool) -> None:
        self.accelerator = accelerator
        self.stats = stats
        self.pool = HostPool(accelerator, pin_memory)
        self.non_blocking = pin_memory and accelerator.supports_pinned_memory  # pageable copies block the host
        self.d2h: Stream | None = accelerator.stream() if mode == "async" else None
        self.h2d: Stream | None = accelerator.stream() if mode == "async" else None
        self._timers = {"d2h_s": CopyTimer(accelerator), "h2d_s": CopyTimer(accelerator)}  # async copies
        self._last: weakref.ref[_BlockCache] | None = None  # the last cache of the running forward
        self._unreleased: _BlockCache | None = None  # async: its copies are still running

    def as_dict(self) -> dict[str, float]:
        """The statistics, for metrics.jsonl (`sc_offload_*`)."""
        stats = {**self.stats.as_dict(), "host_bytes": self.pool.allocated_bytes}
        if self.d2h is not None:  # the copies' own time on their streams, not their enqueue
            stats.update({counter: timer.seconds() for counter, timer in self._timers.items()})
        return stats

    def close(self) -> None:
        """Finish and stop the copy streams and drop the pooled host buffers (the run is over)."""
        self._flush()
        finish_and_close(self.d2h, self.h2d)
        self.pool.clear()

    # ------------------------------------------------------------------ forward

    def new_cache(self) -> _BlockCache:
        cache = _BlockCache(below=self._last() if self._last is not None else None)
        self._last = weakref.ref(cache)
        weakref.finalize(cache, self.pool.give_back, cache.buffers, cache.pending)
        return cache

    def store(self, cache: _BlockCache, out: Any) -> None:
        flat, structure = tree_flatten(out)
        if self.d2h is not None:
            self.d2h.wait_stream(self.accelerator.current_stream())  # the output is ready
        outputs = [self._record(cache, t) if isinstance(t, torch.Tensor) else None for t in flat]
        cache.entries.append(_Entry(outputs, structure))

    def _record(self, cache: _BlockCache, t: torch.Tensor) -> _Recorded:
        nbytes = t.numel() * t.element_size()
        buffer = self.pool.take(nbytes)
        cache.buffers.append(buffer)
        host = buffer.view(t.dtype).view(t.shape)
        self._copy(host, t, self.d2h, "d2h_s")
        self.stats.offloaded_bytes += nbytes
        # `t` itself, not `t.detach()`: below autograd a detached alias gets its own version counter,
        # which would hide an in-place change of the output.
        return _Recorded(host, t, t._version, t.device)

    def finish_forward(self, cache: _BlockCache) -> None:
        """End of the block's forward: release the previous block's outputs (async) or this one's (sync)."""
        if self.d2h is None:
            self._release(cache)
            return
        cache.copied_out = self.d2h.record_event()
        self._flush()
        self._unreleased = cache

    def _flush(self) -> None:
        if self._unreleased is not None:
            self._release(self._unreleased)
            self._unreleased = None

    def _release(self, cache: _BlockCache) -> None:
        """Wait for the block's copies, then drop its device outputs."""
        if cache.copied_out is not None:
            self._timed_wait(cache.copied_out)
        for r in cache.recorded():
            if r.source is None:
                continue
            if r.source._version != r.version:
                raise RuntimeError(
                    "selective_checkpoint_offload: the output of an expensive op was modified in place after "
                    "it was recorded; turn selective_checkpoint_offload off for this model"
                )
            r.source = None

    # ------------------------------------------------------------------ backward

    def begin_replay(self, cache: _BlockCache) -> None:
        """Backward reached the block: its copies back (if not prefetched) and the next block's start."""
        self._flush()  # forward is over: nothing is left to overlap the last block's copies with
        self._last = None
        cache.replay_index = 0
        self._start_load(cache)
        if cache.below is not None and self.h2d is not None:
            self._start_load(cache.below)

    def _start_load(self, cache: _BlockCache) -> None:
        if cache.load_started:
            return
        cache.load_started = True
        recorded = cache.recorded()
        for r in recorded:
            # Allocated on the compute stream, so the caching allocator orders its reuse after this point.
            r.loaded = torch.empty(r.host.shape, dtype=r.host.dtype, device=r.device)
        if self.h2d is None:
            start = time.perf_counter()
            for r in recorded:
                r.loaded.copy_(r.host)
            self.stats.h2d_s += time.perf_counter() - start
            return
        self.h2d.wait_stream(self.accelerator.current_stream())
        for r in recorded:
            self._timers["h2d_s"].run(self.h2d, self._copy_now, r.loaded, r.host)
            # The replay may never come (a partial backward): no reuse while the copy still writes.
            self.accelerator.record_stream(r.loaded, self.h2d)
        cache.loaded = self.h2d.record_event()
        cache.pending.event = cache.loaded

    def load(self, cache: _BlockCache) -> Any:
        """The next recorded output, back on the device (a fresh copy each replay: backward may keep it)."""
        if cache.loaded is not None:
            self._timed_wait(cache.loaded)
            cache.loaded = None
            cache.pending.event = None  # consumed: later users are ordered after the compute stream
        entry = cache.entries[cache.replay_index]
        cache.replay_index += 1
        restored = []
        for r in entry.outputs:
            restored.append(None if r is None else r.loaded)
            if r is not None:
                r.loaded = None
        if cache.replay_index == len(cache.entries):
            cache.load_started = False  # a second backward (retain_graph) loads again
        return tree_unflatten(restored, entry.structure)

    # ------------------------------------------------------------------ copies

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream | None, counter: str) -> None:
        if stream is None:
            start = time.perf_counter()
            dst.copy_(src)
            setattr(self.stats, counter, getattr(self.stats, counter) + time.perf_counter() - start)
        else:
            self._timers[counter].run(stream, self._copy_now, dst, src)

    def _copy_now(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=self.non_blocking)

    def _timed_wait(self, event: Event) -> None:
        start = time.perf_counter()
        event.wait()  # the compute stream waits; on cpu this blocks the caller
        self.stats.wait_s += time.perf_counter() - start


class _RecordMode(TorchDispatchMode):
    """Forward: run every op; send the outputs of the expensive ones to the host."""

    def __init__(self, offloader: SelectiveOffloader, cache: _BlockCache) -> None:
        super().__init__()
        self.offloader = offloader
        self.cache = cache

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in expensive_ops():
            self.offloader.store(self.cache, out)
        return out

    def __exit__(self, *exc: Any) -> Any:
        result = super().__exit__(*exc)
        self.offloader.finish_forward(self.cache)
        return result


class _ReplayMode(TorchDispatchMode):
    """Recompute: answer the expensive ops with their recorded outputs, rerun the cheap ones."""

    def __init__(self, offloader: SelectiveOffloader, cache: _BlockCache) -> None:
        super().__init__()
        self.offloader = offloader
        self.cache = cache

    def __enter__(self) -> _ReplayMode:
        self.offloader.begin_replay(self.cache)  # every backward (retain_graph) replays from the start
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in expensive_ops():
            return self.offloader.load(self.cache)
        return func(*args, **(kwargs or {}))


def apply_selective_offload(
    layers: nn.ModuleList, indices: Sequence[int], *, accelerator: Accelerator, mode: str = "async",
    pin_memory: bool = True,
) -> SelectiveOffloader:  # fmt: skip
    """Selectively checkpoint `layers[i]` with the kept outputs on the host; returns the handle (`as_dict()`)."""
    offloader = SelectiveOffloader(accelerator, mode, SelectiveOffloadStats(), pin_memory)

    def context_fn() -> tuple[_RecordMode, _ReplayMode]:
        cache = offloader.new_cache()
        return _RecordMode(offloader, cache), _ReplayMode(offloader, cache)

    for i in indices:
        checkpoint(layers[i], context_fn=context_fn)
    if indices:
        logger.info("Applied selective checkpointing with host-offloaded outputs to %d of %d blocks",
                    len(indices), len(layers))  # fmt: skip
    return offloader
