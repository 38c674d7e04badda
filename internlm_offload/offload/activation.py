"""Activation offload: the saved tensors of selected decoder blocks go to host memory in forward and
come back for backward.

One *group* per block. Saved-tensor hooks are pushed in a forward pre-hook of each block and popped
in an always-called forward post-hook, so an exception in forward never leaves a hook installed.

Schedule (`mode="async"`, the device-side picture; the CPU accelerator emulates streams with threads):
- forward, block i: each saved activation storage is copied D2H on the `d2h` stream as soon as it is
  saved (after the compute stream's event at that point). At the end of block i+1 the compute stream
  waits for group i's copies and drops its device references: at most two groups' sources are held
  at once (double buffering), and a source is released only after its copy finished.
- backward: the first unpack of group g waits for g's reload (started ahead on the `h2d` stream) and
  starts reloading groups g-1 .. g-prefetch_layers. When every tensor of a group has been unpacked the
  device copies are dropped; the host copies live as long as autograd's graph does (so
  `retain_graph=True` works: a second backward reloads again).
`mode="sync"` copies in the calling thread at save and at unpack: no overlap, the simplest path, and
the one to pick where async pinned copies are unreliable (NPU).

Pipeline (`segments`): the blocks are a rank's stages' blocks in stage order, each stage's run one forward
of its own (a micro-batch). Every stage forward keeps its own groups, released at the stage's end, so a
stage holding several micro-batches in flight keeps each one's activations on the host until its backward.
The schedule runs a stage's backwards in the order of its forwards (1F1B, interleaved 1F1B), so the
oldest forward still waiting for its backward is the stage's next backward: at the end of each stage
forward its top groups start reloading (async), unless it is the forward that just ended (a warm-up
forward). Under 1F1B's steady state a stage's forward is followed by that backward, so the reload overlaps
the wait for its gradient from the next stage, and it comes back only after the forward that raises the
stage's peak. Backwards with no forward before them (the cool-down) reload when their own backward reaches
them, as without a pipeline (where no forward waits at a forward's end).

Memory saved vs time paid: every offloaded block frees its saved activations (about
`34 * B * T * C` bytes per block in fp32 for this model family) at the price of one D2H and one H2D
copy of them; with async copies the transfer hides behind the next block's compute when PCIe/host
bandwidth keeps up.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from internlm_offload.device import Accelerator, Event, PendingCopy, accelerator_for, storage_key
from internlm_offload.features import MemoryFeature
from internlm_offload.log import get_logger
from internlm_offload.offload.host_copies import HostCopies
from internlm_offload.optim.dtensor import Layout, is_dtensor, layout_of, local_shard, with_layout

logger = get_logger(__name__)

NO_OFFLOAD_ATTR = "_internlm_offload_skip"


def mark_not_offload(*tensors: torch.Tensor) -> None:
    """Keep these tensors on the device even when a block that saves them is offloaded."""
    for t in tensors:
        setattr(t, NO_OFFLOAD_ATTR, True)


def no_offload() -> contextlib.AbstractContextManager:
    """A region whose saved tensors stay on the device (innermost saved-tensor hooks win)."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """All bytes of `t`'s storage as a flat uint8 tensor that shares it.

    Built from views where the storage holds whole elements of `t`'s dtype: PyTorch's CUDA sanitizer
    counts `set_` as a write, which would read as a race with a side-stream copy of the same storage
    (a tensor that several blocks save, such as the rotary tables)."""
    nbytes, itemsize = t.untyped_storage().nbytes(), t.element_size()
    if nbytes % itemsize:
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    return t.as_strided((nbytes // itemsize,), (1,), 0).view(torch.uint8)


def typed_view(raw: torch.Tensor, saved: _Saved) -> torch.Tensor:
    """The saved tensor over `raw`, its storage's bytes (by views where they hold whole elements, as above)."""
    if raw.numel() % saved.dtype.itemsize:
        tensor = torch.empty(0, dtype=saved.dtype, device=raw.device)
        return tensor.set_(raw.untyped_storage(), saved.offset, saved.size, saved.stride)
    return raw.view(saved.dtype).as_strided(saved.size, saved.stride, saved.offset)


@dataclass
class _Slot:
    """One offloaded storage: its host copy, and the device bytes while they are needed."""

    host: torch.Tensor  # uint8, nbytes
    source: torch.Tensor | None  # device uint8 view of the storage, held until the D2H copy finished
    reloaded: torch.Tensor | None = None  # device uint8 copy during backward


@dataclass
class _Group:
    """The offloaded storages of one block in one forward pass."""

    index: int
    device: torch.device
    # The groups backward reaches right after this one (lower indices), for prefetching. Strong
    # references point downward only, so groups never form a cycle and die as soon as autograd drops them.
    earlier: list[_Group]
    slots: dict[int, _Slot] = field(default_factory=dict)  # storage_key → slot
    param_storages: set[int] | None = None
    d2h_done: Event | None = None
    h2d_done: Event | None = None
    # Shared with the finalizer that returns the host buffers (which must not hold the group itself).
    pending: PendingCopy = field(default_factory=PendingCopy)
    packed: int = 0
    unpacked: int = 0
    nbytes: int = 0


@dataclass(eq=False)
class _Flight:
    """One stage forward awaiting its backward: its top offloaded groups (held weakly: autograd owns them)."""

    segment: int
    top: list[weakref.ref[_Group]] = field(default_factory=list)
    started: bool = False  # its backward has begun


@dataclass(frozen=True)
class _Saved:
    """What autograd holds for an offloaded tensor: enough to rebuild it from its group's storage."""

    group: _Group
    key: int
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool
    flight: _Flight | None = None


@dataclass
class _SavedShard:
    """A saved DTensor (tensor parallel): its local shard saved as any tensor, its layout to rebuild it."""

    local: Any  # what pack returned for the local shard
    layout: Layout


@dataclass
class _Resident:
    """A saved tensor that stays on the device; wrapped only to account for its lifetime."""

    tensor: torch.Tensor
    nbytes: int
    unpacked: bool = False
    # Saved by the first block above the offloaded ones: the groups to start reloading when backward
    # reaches it, so that the first offloaded block's copy overlaps this block's backward.
    prefetch: list[_Group] = field(default_factory=list)
    flight: _Flight | None = None


class _Forward:
    """The groups of one forward pass (of one stage); several may be alive at once (gradient accumulation,
    a pipeline's micro-batches in flight)."""

    def __init__(self, num_groups: int, segment: int) -> None:
        self.groups: list[_Group | None] = [None] * num_groups
        self.pending_release: list[_Group] = []
        self.flight = _Flight(segment)


class ActivationOffloader(MemoryFeature):
    """Saved-tensor hooks that offload the activations of `layers[:num_layers]`; see the module doc.

    `segments`: the block counts of the modules that each run a forward of their own, in order (a pipeline
    rank's stages); None: one forward through all blocks."""

    def __init__(
        self,
        layers: nn.ModuleList,
        num_layers: int,
        *,
        mode: str = "async",
        min_offload_bytes: int = 1024,
        prefetch_layers: int = 1,
        pin_memory: bool = True,
        accelerator: Accelerator | None = None,
        segments: Sequence[int] | None = None,
    ) -> None:
        _validate(len(layers), num_layers, mode, min_offload_bytes, prefetch_layers)
        segments = list(segments) if segments is not None else [len(layers)]
        if sum(segments) != len(layers) or min(segments) < 1:
            raise ValueError(f"segments={segments} must be positive block counts adding up to {len(layers)}")
        # each block's segment; a segment's first block starts a forward, its last ends it
        self._segment_of = [s for s, count in enumerate(segments) for _ in range(count)]
        self._starts = {sum(segments[:s]) for s in range(len(segments))}
        self._ends = {sum(segments[: s + 1]) - 1 for s in range(len(segments))}
        # per segment, its forwards whose backward has not started, in forward order
        self._waiting: dict[int, deque[_Flight]] = {}
        self.layers = layers
        self.num_layers = num_layers
        self.mode = mode
        self.min_offload_bytes = min_offload_bytes
        self.prefetch_layers = prefetch_layers
        self.accelerator = accelerator or accelerator_for(layers.parameters())
        if mode == "async" and self.accelerator.supports_pinned_memory and not pin_memory:
            logger.warning(
                "activation offload: mode='async' with pin_memory=False copies from pageable memory, which blocks "
                "the host on %s; async gains nothing over sync. Set pin_memory=True",
                self.accelerator.name,
            )
        self.copies = HostCopies(self.accelerator, asynchronous=mode == "async", pin_memory=pin_memory)
        self._forward: _Forward | None = None
        self._hook_stack: list[contextlib.AbstractContextManager] = []
        self._handles: list[RemovableHandle] = []
        self._stats = _Stats()
        self._install()
        if num_layers:
            logger.info("Applied %s activation offload to %d of %d blocks", mode, num_layers, len(layers))

    # ------------------------------------------------------------------ hooks around blocks

    def _install(self) -> None:
        # Our saved-tensor hooks must be the OUTER ones: activation checkpointing (torch's composable
        # `checkpoint`, which enters its hooks in a pre-hook and leaves them in a prepended post-hook)
        # must stay innermost in the blocks it wraps, or its tensors would be saved through us instead.
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._make_pre_hook(i), prepend=True))
            self._handles.append(layer.register_forward_hook(self._make_post_hook(i), always_call=True))

    def _make_pre_hook(self, index: int):
        def pre_hook(module: nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled() or _in_backward():
                return  # no-grad forward (nothing is saved) or a checkpoint's recompute (it saves its own way)
            if index in self._starts or self._forward is None:
                self._start_forward(self._segment_of[index])
            hooks = torch.autograd.graph.saved_tensors_hooks(self._make_pack(index, module), self._unpack)
            hooks.__enter__()
            self._hook_stack.append(hooks)

        return pre_hook

    def _make_post_hook(self, index: int):
        def post_hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._hook_stack or _in_backward():
                return
            self._hook_stack.pop().__exit__(None, None, None)
            forward = self._forward
            if forward is None:
                return
            group = forward.groups[index] if index < self.num_layers else None
            if group is not None and self.copies.d2h is not None:
                group.d2h_done = self.copies.d2h.record_event()
            # Double buffering: the previous group's copies had a whole block to finish. Sources are
            # held at least to the end of their own block: a freed storage's address could otherwise be
            # reused by a new tensor of the same block and mistaken for an already offloaded storage.
            for older in forward.pending_release:
                self._release_sources(older)
            forward.pending_release = []
            if group is not None and self.copies.d2h is None:
                self._release_sources(group)  # sync: the copies are done
            elif group is not None:
                forward.pending_release = [group]
            if index in self._ends:
                self._wait_for_backward(forward)
                self._end_forward()  # a stage's last block may be offloaded: its copies finish here
                self._reload_next_backward(forward.flight)

        return post_hook

    def _wait_for_backward(self, forward: _Forward) -> None:
        """Queue a finished forward that offloaded something, with its top groups, for its stage's backward."""
        top = [g for g in reversed(forward.groups) if g is not None][: self.prefetch_layers]
        if top:
            forward.flight.top = [weakref.ref(g) for g in top]
            self._waiting.setdefault(forward.flight.segment, deque()).append(forward.flight)

    def _end_forward(self) -> None:
        """Forget the current forward, releasing the sources it still holds once their copies finished.

        A forward normally ends at the last block with nothing pending; one cut short by an exception
        still holds its last group's sources, whose D2H copies may be queued: dropping them unwaited
        would hand their memory back to the allocator while the copy still reads it.
        """
        if self._forward is not None:
            for group in self._forward.pending_release:
                self._release_sources(group)
        self._forward = None

    def _start_forward(self, segment: int) -> None:
        self._end_forward()
        self._forward = _Forward(self.num_layers, segment)
        if not self._in_flight():  # a pipeline's figures cover the forwards in flight together (a step's)
            self._stats.start_forward()
            self.copies.reset_figures()

    def _in_flight(self) -> bool:
        """Whether a forward that offloaded waits for its backward (those whose graph died are dropped)."""
        for waiting in self._waiting.values():
            while waiting and all(ref() is None for ref in waiting[0].top):
                waiting.popleft()
        return any(self._waiting.values())

    # ------------------------------------------------------------------ pack (forward)

    def _make_pack(self, index: int, module: nn.Module):
        offloaded = index < self.num_layers
        prefetches = index == self.num_layers and self.copies.h2d is not None

        def pack(t: torch.Tensor) -> Any:
            if is_dtensor(t):  # only this rank's bytes move; unpack wraps them in the same layout again
                return _SavedShard(pack(local_shard(t.detach())), layout_of(t))
            nbytes = t.numel() * t.element_size()
            if not offloaded or not self._should_offload(t, nbytes, module, index):
                self._stats.add_resident(nbytes)
                # Detached: a saved *output* of a node would otherwise hold its own grad_fn, a cycle through
                # C++ that the garbage collector cannot break, leaking the whole graph (and every offloaded
                # host buffer) whenever backward does not run through all of it (autograd.grad on a subset).
                prefetch = self._groups_below(index) if prefetches else []
                return _Resident(t.detach(), nbytes, prefetch=prefetch, flight=self._flight())
            return self._offload(t, index)

        return pack

    def _groups_below(self, index: int) -> list[_Group]:
        """The offloaded groups backward reaches right after block `index`, nearest first."""
        if self._forward is None:
            return []
        groups = self._forward.groups[max(0, index - self.prefetch_layers) : index]
        return [g for g in reversed(groups) if g is not None]

    def _should_offload(self, t: torch.Tensor, nbytes: int, module: nn.Module, index: int) -> bool:
        if type(t) is not torch.Tensor or nbytes < self.min_offload_bytes or nbytes == 0:
            return False  # parameters, fake/functional tensors during tracing, tiny tensors
        if getattr(t, NO_OFFLOAD_ATTR, False) or self._is_host(t):
            return False
        group = self._group(index, t.device)
        if group.param_storages is None:
            # Refreshed per forward: FSDP2 re-allocates unsharded parameter storages every all-gather.
            # DTensor params (tensor parallel): their local shards are what a saved shard may alias.
            group.param_storages = {storage_key(local_shard(p.detach())) for p in module.parameters()}
        return storage_key(t) not in group.param_storages

    def _is_host(self, t: torch.Tensor) -> bool:
        if self.accelerator.name == "cpu":
            return False  # every tensor is "device" memory in the cpu emulation
        return t.device.type == "cpu"

    def _group(self, index: int, device: torch.device) -> _Group:
        assert self._forward is not None, "pack outside a forward"
        groups = self._forward.groups
        if groups[index] is None:
            earlier = [g for g in reversed(groups[max(0, index - self.prefetch_layers) : index]) if g is not None]
            groups[index] = _Group(index, device, earlier)
        return groups[index]

    def _offload(self, t: torch.Tensor, index: int) -> _Saved:
        group = self._group(index, t.device)
        key = storage_key(t)
        if key not in group.slots:
            source = storage_bytes(t)
            slot = _Slot(host=self.copies.pool.take(source.numel()), source=source)
            group.slots[key] = slot
            group.nbytes += source.numel()
            self._stats.add_host_copy(source.numel())
            self._copy_out(slot)
            # The host copy lives as long as the group, i.e. as long as autograd's graph needs it.
            weakref.finalize(group, self.copies.pool.give_back, [slot.host], group.pending)
        group.packed += 1
        self._stats.offloaded_bytes += t.numel() * t.element_size()
        return _Saved(group, key, t.dtype, t.size(), t.stride(), t.storage_offset(), t.requires_grad, self._flight())

    def _flight(self) -> _Flight | None:
        return self._forward.flight if self._forward is not None else None

    def _copy_out(self, slot: _Slot) -> None:
        self.copies.to_host([(slot.host, slot.source)])

    def _release_sources(self, group: _Group) -> None:
        """Drop the device copies of a group once its D2H copies finished."""
        if group.d2h_done is not None:
            self.copies.wait(group.d2h_done)
        for slot in group.slots.values():
            slot.source = None
        self._stats.release(group.nbytes)

    # ------------------------------------------------------------------ unpack (backward)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _SavedShard):
            return with_layout(self._unpack(saved.local), saved.layout)
        if saved.flight is not None and not saved.flight.started:
            self._backward_starts(saved.flight)
        if isinstance(saved, _Resident):
            for group in saved.prefetch:
                self._start_reload(group)
            if not saved.unpacked:
                saved.unpacked = True
                self._stats.release_resident(saved.nbytes)
            return saved.tensor
        group = saved.group
        self._ensure_reloaded(group)
        for ahead in group.earlier:
            self._start_reload(ahead)
        slot = group.slots[saved.key]
        assert slot.reloaded is not None
        tensor = typed_view(slot.reloaded, saved)
        group.unpacked += 1
        if group.unpacked == group.packed:
            # Every saved tensor of the group is back with autograd: our device references can go.
            for s in group.slots.values():
                s.reloaded = None
            group.unpacked = 0
            group.h2d_done = None
            self._stats.release(group.nbytes)
        return tensor

    def _backward_starts(self, flight: _Flight) -> None:
        """A stage forward's backward begins (its first unpack): it no longer waits."""
        flight.started = True
        waiting = self._waiting.get(flight.segment)
        if waiting and flight in waiting:
            waiting.remove(flight)

    def _reload_next_backward(self, ended: _Flight) -> None:
        """After a stage forward: start reloading the stage's next backward, the oldest forward waiting for
        one (the schedule's order), unless that is the forward that just ended."""
        self._in_flight()  # drops the forwards whose graph died without a backward
        waiting = self._waiting.get(ended.segment)
        if not waiting or waiting[0] is ended or self.copies.h2d is None:  # sync copies reload on demand
            return
        for ref in waiting[0].top:
            group = ref()
            if group is not None:
                self._start_reload(group)

    def _start_reload(self, group: _Group) -> None:
        if group.h2d_done is not None or all(s.reloaded is not None for s in group.slots.values()):
            return
        for slot in group.slots.values():
            # Allocated on the compute stream, so the caching allocator orders its reuse after this point.
            slot.reloaded = torch.empty(slot.host.numel(), dtype=torch.uint8, device=group.device)
        self._stats.reload(group.nbytes)
        # Backward may never consume a prefetch: then the pending event keeps the host buffers from reuse.
        group.h2d_done = self.copies.reload([(slot.reloaded, slot.host) for slot in group.slots.values()])
        group.pending.event = group.h2d_done

    def _ensure_reloaded(self, group: _Group) -> None:
        self._start_reload(group)
        if group.h2d_done is not None:
            self.copies.wait(group.h2d_done)
            group.pending.event = None  # consumed: later users are ordered after the compute stream

    # ------------------------------------------------------------------ public surface

    def metrics(self) -> dict[str, float]:
        """Byte accounting of the last forward and copy and wait seconds since it started (`act_offload_*`); under
        a pipeline of the last forwards in flight together (the step's on the first stage)."""
        figures = {**self._stats.as_dict(), **self.copies.figures()}
        return {f"act_offload_{key}": value for key, value in figures.items()}

    def close(self) -> None:
        """Uninstall every hook (the blocks behave exactly as before), then close the copy engine."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        while self._hook_stack:
            self._hook_stack.pop().__exit__(None, None, None)
        self._end_forward()
        self._waiting.clear()
        self.copies.close()


@dataclass
class _Stats:
    """Saved-activation byte accounting of the last forward (the copy and wait times are the engine's)."""

    offloaded_bytes: int = 0  # bytes of the saved tensors that went to the host (as autograd counts them)
    host_bytes: int = 0  # bytes actually copied: each storage once
    resident_bytes: int = 0
    live_resident_bytes: int = 0  # resident bytes autograd has not handed back to backward yet
    peak_resident_bytes: int = 0
    in_flight_bytes: int = 0  # offloaded sources not yet released, or reloaded groups

    def start_forward(self) -> None:
        self.offloaded_bytes = self.host_bytes = self.resident_bytes = self.live_resident_bytes = 0
        self.peak_resident_bytes = self.in_flight_bytes = 0

    def add_resident(self, nbytes: int) -> None:
        self.resident_bytes += nbytes
        self.live_resident_bytes += nbytes
        self._update_peak()

    def release_resident(self, nbytes: int) -> None:
        self.live_resident_bytes -= nbytes

    def add_host_copy(self, nbytes: int) -> None:
        """A storage starts its trip to the host; its device bytes stay until the group is released."""
        self.host_bytes += nbytes
        self.in_flight_bytes += nbytes
        self._update_peak()

    def release(self, nbytes: int) -> None:
        self.in_flight_bytes -= nbytes

    def reload(self, nbytes: int) -> None:
        self.in_flight_bytes += nbytes
        self._update_peak()

    def _update_peak(self) -> None:
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.live_resident_bytes + self.in_flight_bytes)

    def as_dict(self) -> dict[str, float]:
        return {
            "offloaded_bytes": self.offloaded_bytes,
            "host_bytes": self.host_bytes,
            "resident_bytes": self.resident_bytes,
            "peak_resident_bytes": self.peak_resident_bytes,
        }


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward (where checkpointed blocks recompute)."""
    return torch._C._current_graph_task_id() != -1  # the same test torch.utils.checkpoint uses


def _validate(total: int, num_layers: int, mode: str, min_offload_bytes: int, prefetch_layers: int) -> None:
    if not 0 <= num_layers < total:
        raise ValueError(f"num_layers={num_layers} must be in [0, {total}): the last block is never offloaded")
    if mode not in ("sync", "async"):
        raise ValueError(f"mode={mode!r} must be 'sync' or 'async'")
    if min_offload_bytes < 0:
        raise ValueError(f"min_offload_bytes={min_offload_bytes} must be >= 0")
    if prefetch_layers < 1:
        raise ValueError(f"prefetch_layers={prefetch_layers} must be >= 1")


def copy_mode(requested: str, device_type: str) -> str:
    """`auto` → `async`, except `sync` on NPU (async pinned copies are unreliable there); else as requested."""
    if requested != "auto":
        return requested
    return "sync" if device_type == "npu" else "async"


# The public entry point: offload the saved activations of `layers[:num_layers]`; returns the handle.
offload_layers = ActivationOffloader
