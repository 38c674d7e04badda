"""Selective checkpointing whose kept tensors live on the host (`selective_checkpoint_offload=True`).

Selective checkpointing keeps the outputs of the expensive ops (matmuls, attention) and recomputes
the cheap ones. Here the kept outputs do not stay on the device either: in forward each one is
copied to host memory (asynchronously on a side stream when `mode="async"`); when backward recomputes
the block, the expensive ops are not run again but answered with their outputs brought back from the
host. The device then holds nothing of the block between its forward and its backward except what
checkpointing itself keeps (the block's inputs).

It is built from two dispatch modes handed to `torch.utils.checkpoint` as its `context_fn`: one that
records the expensive outputs during forward, one that replays them during the recompute. Both sit
below autograd, so the recomputed graph is the same graph; the replayed values are the recorded bytes,
so gradients are bitwise those of no checkpointing.

Memory saved vs time paid: like selective checkpointing, plus the kept matmul/attention outputs
(for this model family roughly `(6 + 4 * mlp_ratio) * B * T * C` values per block) leave the device,
at the price of one D2H and one H2D copy of them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from internlm_offload.device import Accelerator, Event, Stream
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

    host: torch.Tensor
    source: torch.Tensor | None  # the device tensor, held until the copy-out finished
    version: int
    device: torch.device


@dataclass
class _Entry:
    """The outputs of one recorded op (None for non-tensor outputs) and their pytree structure."""

    outputs: list[_Recorded | None]
    structure: Any


@dataclass
class _BlockCache:
    """The recorded outputs of one block call, in op order."""

    entries: list[_Entry] = field(default_factory=list)
    copied_out: Event | None = None
    replay_index: int = 0


class _Offloader:
    """Moves recorded outputs to host and back, on the accelerator's streams."""

    def __init__(self, accelerator: Accelerator, mode: str, stats: SelectiveOffloadStats) -> None:
        self.accelerator = accelerator
        self.stats = stats
        self.d2h: Stream | None = accelerator.stream() if mode == "async" else None

    def store(self, cache: _BlockCache, out: Any) -> None:
        flat, structure = tree_flatten(out)
        if self.d2h is not None:
            self.d2h.wait_stream(self.accelerator.current_stream())  # the output is ready
        outputs = [self._record(t) if isinstance(t, torch.Tensor) else None for t in flat]
        cache.entries.append(_Entry(outputs, structure))
        if self.d2h is not None:
            cache.copied_out = self.d2h.record_event()

    def _record(self, t: torch.Tensor) -> _Recorded:
        host = self.accelerator.host_empty(t.shape, t.dtype, pinned=True)
        self._copy(host, t, self.d2h, "d2h_s")
        self.stats.offloaded_bytes += t.numel() * t.element_size()
        # `t` itself, not `t.detach()`: below autograd a detached alias gets its own version counter,
        # which would hide an in-place change of the output.
        return _Recorded(host, t, t._version, t.device)

    def release(self, cache: _BlockCache) -> None:
        """After the block's forward: wait for its copies, then drop the device outputs."""
        if cache.copied_out is not None:
            start = time.perf_counter()
            cache.copied_out.wait()
            self.stats.wait_s += time.perf_counter() - start
        recorded = [r for entry in cache.entries for r in entry.outputs if r is not None and r.source is not None]
        for r in recorded:
            if r.source._version != r.version:
                raise RuntimeError(
                    "selective_checkpoint_offload: the output of an expensive op was modified in place after "
                    "it was recorded; turn selective_checkpoint_offload off for this model"
                )
            r.source = None

    def load(self, cache: _BlockCache) -> Any:
        """The next recorded output, back on the device (a fresh copy: backward may keep it)."""
        entry = cache.entries[cache.replay_index]
        cache.replay_index += 1
        start = time.perf_counter()
        restored = [None if r is None else r.host.to(r.device, copy=True) for r in entry.outputs]
        self.stats.h2d_s += time.perf_counter() - start
        return tree_unflatten(restored, entry.structure)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream | None, counter: str) -> None:
        if stream is None:
            start = time.perf_counter()
            dst.copy_(src)
            setattr(self.stats, counter, getattr(self.stats, counter) + time.perf_counter() - start)
        else:
            stream.submit(self._timed_copy, dst, src, counter)

    def _timed_copy(self, dst: torch.Tensor, src: torch.Tensor, counter: str) -> None:
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        setattr(self.stats, counter, getattr(self.stats, counter) + time.perf_counter() - start)


class _RecordMode(TorchDispatchMode):
    """Forward: run every op; send the outputs of the expensive ones to the host."""

    def __init__(self, offloader: _Offloader, cache: _BlockCache) -> None:
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
        self.offloader.release(self.cache)
        return result


class _ReplayMode(TorchDispatchMode):
    """Recompute: answer the expensive ops with their recorded outputs, rerun the cheap ones."""

    def __init__(self, offloader: _Offloader, cache: _BlockCache) -> None:
        super().__init__()
        self.offloader = offloader
        self.cache = cache

    def __enter__(self) -> _ReplayMode:
        self.cache.replay_index = 0  # every backward (retain_graph) replays from the start
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in expensive_ops():
            return self.offloader.load(self.cache)
        return func(*args, **(kwargs or {}))


def apply_selective_offload(
    layers: nn.ModuleList, indices: Sequence[int], *, accelerator: Accelerator, mode: str = "async"
) -> SelectiveOffloadStats:
    """Selectively checkpoint `layers[i]` with the kept outputs on the host; returns live statistics."""
    stats = SelectiveOffloadStats()
    offloader = _Offloader(accelerator, mode, stats)

    def context_fn() -> tuple[_RecordMode, _ReplayMode]:
        cache = _BlockCache()
        return _RecordMode(offloader, cache), _ReplayMode(offloader, cache)

    for i in indices:
        checkpoint(layers[i], context_fn=context_fn)
    if indices:
        logger.info("Applied selective checkpointing with host-offloaded outputs to %d of %d blocks",
                    len(indices), len(layers))  # fmt: skip
    return stats

