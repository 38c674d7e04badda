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

Under a pipeline (`segments`: the rank's blocks per stage) each stage forward is a forward of its own: its last
block's outputs are released at the stage's end, and its first block does not chain to the block recorded
before it (another micro-batch's, whose backward the schedule runs apart).

Memory saved vs time paid: like selective checkpointing, plus the kept matmul/attention outputs
(for this model family roughly `(6 + 4 * mlp_ratio) * B * T * C` values per block) leave the device,
at the price of one D2H and one H2D copy of them; async holds one extra block's outputs in forward
(the previous block's, until its copies finished) and in backward (the prefetched block's).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from internlm_offload.device import Accelerator, Event, PendingCopy
from internlm_offload.features import MemoryFeature
from internlm_offload.log import get_logger
from internlm_offload.offload.checkpointing import expensive_ops
from internlm_offload.offload.host_copies import CopyPair, HostCopies
from internlm_offload.optim.dtensor import Layout, is_dtensor, layout_of, local_shard, with_layout

logger = get_logger(__name__)


@dataclass
class _Recorded:
    """One recorded output tensor on its way to and from the host."""

    host: torch.Tensor  # a view of a pooled buffer, with the output's (local shard's) shape and dtype
    source: torch.Tensor | None  # the device tensor, held until the copy-out finished
    version: int
    device: torch.device
    loaded: torch.Tensor | None = None  # the device copy a replay hands to the recompute
    layout: Layout | None = None  # a DTensor output's (tensor parallel): its local shard moves, this rebuilds it


@dataclass
class _Entry:
    """The outputs of one recorded op and their pytree structure. Non-tensor outputs are kept as they are:
    cuda's flash attention returns its sequence lengths as ints, torch_npu's fused attention its seed and
    offset, and the replay must hand back those exact values."""

    outputs: list[_Recorded | Any]
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
        return [r for entry in self.entries for r in entry.outputs if isinstance(r, _Recorded)]


class SelectiveOffloader(MemoryFeature):
    """Selectively checkpoints `layers[i]` for i in `indices`, moving the kept outputs to host and back through
    its copy engine; `metrics()` counts what it did. `segments`: as `ActivationOffloader`'s (a pipeline rank's
    blocks per stage)."""

    def __init__(
        self,
        layers: nn.ModuleList,
        indices: Sequence[int],
        *,
        accelerator: Accelerator,
        mode: str = "async",
        pin_memory: bool = True,
        segments: Sequence[int] | None = None,
    ) -> None:
        self.offloaded_bytes = 0  # of the kept outputs sent to the host, cumulative over the run
        self.copies = HostCopies(accelerator, asynchronous=mode == "async", pin_memory=pin_memory)
        self._last: weakref.ref[_BlockCache] | None = None  # the last cache of the running forward
        self._unreleased: _BlockCache | None = None  # async: its copies are still running
        self._handles: list[RemovableHandle] = []
        if segments is not None and indices:
            self._split_forwards(layers, list(segments))
        for i in indices:
            checkpoint(layers[i], context_fn=self._context_fn)
        if indices:
            logger.info(
                "Applied selective checkpointing with host-offloaded outputs to %d of %d blocks",
                len(indices),
                len(layers),
            )

    def _split_forwards(self, layers: nn.ModuleList, segments: list[int]) -> None:
        """Each segment's first block starts a forward (before checkpoint's own pre-hook asks for a cache), its
        last one ends it, waiting for its copies."""
        start = 0
        for count in segments:
            self._handles.append(layers[start].register_forward_pre_hook(self._stage_boundary, prepend=True))
            end = layers[start + count - 1]
            self._handles.append(end.register_forward_hook(self._stage_boundary, always_call=True))
            start += count

    def _stage_boundary(self, module: nn.Module, *_: Any) -> None:
        """A stage forward starts or ends: the last block's outputs are released, nothing chains across it."""
        if torch.is_grad_enabled():
            self._flush()
            self._last = None

    def _context_fn(self) -> tuple[_RecordMode, _ReplayMode]:
        """The dispatch modes of one block call: its forward records, its recompute replays."""
        cache = self.new_cache()
        return _RecordMode(self, cache), _ReplayMode(self, cache)

    def metrics(self) -> dict[str, float]:
        """Bytes sent to the host, copy and wait seconds and pooled host bytes, cumulative (`sc_offload_*`)."""
        figures = {
            "offloaded_bytes": self.offloaded_bytes,
            **self.copies.figures(),
            "host_bytes": self.copies.pool.allocated_bytes,
        }
        return {f"sc_offload_{key}": value for key, value in figures.items()}

    def close(self) -> None:
        """Finish and stop the copy streams and drop the pooled host buffers (the run is over)."""
        for handle in self._handles:
            handle.remove()
        self._flush()
        self.copies.close()

    # ------------------------------------------------------------------ forward

    def new_cache(self) -> _BlockCache:
        cache = _BlockCache(below=self._last() if self._last is not None else None)
        self._last = weakref.ref(cache)
        weakref.finalize(cache, self.copies.pool.give_back, cache.buffers, cache.pending)
        return cache

    def store(self, cache: _BlockCache, out: Any) -> None:
        flat, structure = tree_flatten(out)
        outputs: list[_Recorded | Any] = []
        self.copies.to_host(self._record_all(cache, flat, outputs))
        cache.entries.append(_Entry(outputs, structure))

    def _record_all(self, cache: _BlockCache, flat: list[Any], outputs: list[_Recorded | Any]) -> list[CopyPair]:
        """Record the tensors of `flat` into `outputs`; returns each one's copy out.

        Every host buffer is taken before any copy is queued: taking a buffer that a reload may still read
        makes the compute stream wait for that reload, and the copy stream's own wait (in `to_host`) must come
        after it, or the copy could overwrite the buffer while the reload reads it.
        """
        pairs: list[CopyPair] = []
        for t in flat:
            if not isinstance(t, torch.Tensor):
                outputs.append(t)
                continue
            local = local_shard(t)  # this rank's bytes only (a DTensor's shard under tensor parallel)
            nbytes = local.numel() * local.element_size()
            buffer = self.copies.pool.take(nbytes)
            cache.buffers.append(buffer)
            host = buffer.view(local.dtype).view(local.shape)
            # `t` itself, not `t.detach()`: below autograd a detached alias gets its own version counter,
            # which would hide an in-place change of the output.
            layout = layout_of(t) if is_dtensor(t) else None
            outputs.append(_Recorded(host, t, t._version, t.device, layout=layout))
            pairs.append((host, local))
            self.offloaded_bytes += nbytes
        return pairs

    def finish_forward(self, cache: _BlockCache) -> None:
        """End of the block's forward: release the previous block's outputs (async) or this one's (sync)."""
        if self.copies.d2h is None:
            self._release(cache)
            return
        cache.copied_out = self.copies.d2h.record_event()
        self._flush()
        self._unreleased = cache

    def _flush(self) -> None:
        if self._unreleased is not None:
            self._release(self._unreleased)
            self._unreleased = None

    def _release(self, cache: _BlockCache) -> None:
        """Wait for the block's copies, then drop its device outputs."""
        if cache.copied_out is not None:
            self.copies.wait(cache.copied_out)
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
        if cache.below is not None and self.copies.h2d is not None:
            self._start_load(cache.below)

    def _start_load(self, cache: _BlockCache) -> None:
        if cache.load_started:
            return
        cache.load_started = True
        recorded = cache.recorded()
        for r in recorded:
            # Allocated on the compute stream, so the caching allocator orders its reuse after this point.
            r.loaded = torch.empty(r.host.shape, dtype=r.host.dtype, device=r.device)
        # The replay may never come (a partial backward): then the pending event keeps the host buffers from reuse.
        cache.loaded = self.copies.reload([(r.loaded, r.host) for r in recorded])
        cache.pending.event = cache.loaded

    def load(self, cache: _BlockCache) -> Any:
        """The next recorded output, back on the device (a fresh copy each replay: backward may keep it)."""
        if cache.loaded is not None:
            self.copies.wait(cache.loaded)
            cache.loaded = None
            cache.pending.event = None  # consumed: later users are ordered after the compute stream
        entry = cache.entries[cache.replay_index]
        cache.replay_index += 1
        restored = []
        for r in entry.outputs:
            if not isinstance(r, _Recorded):
                restored.append(r)
                continue
            restored.append(r.loaded if r.layout is None else with_layout(r.loaded, r.layout))
            r.loaded = None
        if cache.replay_index == len(cache.entries):
            cache.load_started = False  # a second backward (retain_graph) loads again
        return tree_unflatten(restored, entry.structure)


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


# The public entry point: selectively checkpoint `layers[i]` with the kept outputs on the host; returns the handle.
apply_selective_offload = SelectiveOffloader
