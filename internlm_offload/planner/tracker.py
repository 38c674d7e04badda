"""Live tensor memory of a traced step, by tier, without allocating it.

`StorageTracker` is a dispatch mode that sees every op of the traced step (run on meta tensors) and
records each new storage once (a DTensor's by its local shard), with its byte size and tier: "host"
when the planning accelerator allocated it as host memory (`host_empty`, "pinned" too when asked page-locked),
"disk" for a file-backed buffer (`disk_buffer`, the NVMe tier), "device" otherwise. A storage stops counting
when its last tensor is collected, exactly when the caching allocator would get the block back; so the current
and peak bytes it reports are those of `memory_allocated()` / `max_memory_allocated()` on a device.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from internlm_offload.device import storage_key
from internlm_offload.config.sizes import human_bytes

META = torch.device("meta")
TIERS = ("device", "host", "pinned", "disk")  # "pinned": the host bytes asked for page-locked (a subset of "host")


@dataclass
class TierCounter:
    current: int = 0
    peak: int = 0
    window: int = 0  # the peak since the last `StorageTracker.take_window`: one segment of a step

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        self.window = max(self.window, self.current)


@dataclass(eq=False)
class StorageTracker(TorchDispatchMode):
    """Counts live storages per tier while active; see the module docstring."""

    counters: dict[str, TierCounter] = field(default_factory=lambda: {tier: TierCounter() for tier in TIERS})
    _live: dict[int, tuple[int, tuple[str, ...]]] = field(default_factory=dict)  # storage key -> (bytes, tiers)
    _new_tiers: tuple[str, ...] = ("device",)  # the tiers of storages created now

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if copies_meta_to_cpu(func, args, kwargs):
            # A device-to-host copy in a traced step (FSDP2's CPU offload moves each reduce-scattered gradient
            # shard so): the copy stays on meta, counted as host memory.
            out = func(*args, **{**(kwargs or {}), "device": META, "pin_memory": None})
            self.track(out, ("host",))
            return out
        out = func(*args, **(kwargs or {}))
        tiers = self._derived_tiers(args, kwargs)
        for value in tensor_leaves(out):
            self.track(value, tiers)
        return out

    def _derived_tiers(self, args: tuple, kwargs: dict | None) -> tuple[str, ...]:
        """A new storage computed from host tensors only is host memory (a CPU optimizer's states, the host
        upcast of a grad); from anything on the device, or from nothing (a factory), the current default."""
        inputs = [self.tier_of(t) for t in tensor_leaves((args, kwargs))]
        return ("host",) if inputs and all(tier == "host" for tier in inputs) else self._new_tiers

    def track(self, tensor: torch.Tensor, tiers: tuple[str, ...] | None = None) -> None:
        """Count `tensor`'s storage (once) until its last tensor is gone; a DTensor's, its local shard's
        (its own storage reports the full logical size)."""
        for plain in plain_tensors(tensor):
            self._track_storage(plain, tiers)

    def _track_storage(self, tensor: torch.Tensor, tiers: tuple[str, ...] | None) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata  # `storage_key`
        if key in self._live:
            return
        tiers = tiers or self._new_tiers
        nbytes = storage.nbytes()
        self._live[key] = (nbytes, tiers)
        for tier in tiers:
            self.counters[tier].add(nbytes)
        weakref.finalize(storage, self._free, key)

    @contextlib.contextmanager
    def counting_resizes(self) -> Iterator[None]:
        """Count in-place storage resizes while inside: FSDP2 frees an unsharded parameter with `resize_(0)`
        and allocates it again with `resize_(n)`, keeping the same storage (no op the dispatch mode sees)."""
        resize = torch.UntypedStorage.resize_
        tracker = self

        def counted_resize(storage: torch.UntypedStorage, nbytes: int) -> torch.UntypedStorage:
            out = resize(storage, nbytes)
            tracker._resized(storage._cdata, storage.nbytes())
            return out

        torch.UntypedStorage.resize_ = counted_resize
        try:
            yield
        finally:
            torch.UntypedStorage.resize_ = resize

    def _resized(self, key: int, nbytes: int) -> None:
        if key not in self._live:
            return
        before, tiers = self._live[key]
        self._live[key] = (nbytes, tiers)
        for tier in tiers:
            self.counters[tier].add(nbytes - before)

    @contextlib.contextmanager
    def allocating_host(self, pinned: bool) -> Iterator[None]:
        """Storages created inside count as host memory (the planning accelerator's `host_empty`)."""
        with self.allocating(("host", "pinned") if pinned else ("host",)):
            yield

    @contextlib.contextmanager
    def allocating(self, tiers: tuple[str, ...]) -> Iterator[None]:
        """Storages created inside count in `tiers` ("disk": the planning accelerator's `disk_buffer`)."""
        self._new_tiers = tiers
        try:
            yield
        finally:
            self._new_tiers = ("device",)

    def move_to(self, tensor: torch.Tensor, tiers: tuple[str, ...]) -> None:
        """Count `tensor`'s (tracked) storage in `tiers` from now on: where the run would have put it."""
        for plain in plain_tensors(tensor):
            key = storage_key(plain)
            if key not in self._live:
                continue
            nbytes, before = self._live[key]
            for tier in before:
                self.counters[tier].current -= nbytes
            for tier in tiers:
                self.counters[tier].add(nbytes)
            self._live[key] = (nbytes, tiers)

    def tier_of(self, tensor: torch.Tensor) -> str | None:
        """ "device" or "host" for a tracked tensor; None for one made outside the tracker."""
        entry = self._live.get(storage_key(plain_tensors(tensor)[0]))
        return None if entry is None else entry[1][0]

    def live_bytes(self, tier: str) -> int:
        return self.counters[tier].current

    def peak_bytes(self, tier: str) -> int:
        return self.counters[tier].peak

    def reset_peaks(self) -> None:
        """Peaks restart from what is live now (`reset_peak_memory_stats`)."""
        for counter in self.counters.values():
            counter.peak = counter.window = counter.current

    def take_window(self, tier: str) -> int:
        """The peak since the last call (or `reset_peaks`); the next window starts from what is live now."""
        counter = self.counters[tier]
        peak, counter.window = counter.window, counter.current
        return peak

    def _free(self, key: int) -> None:
        nbytes, tiers = self._live.pop(key)
        for tier in tiers:
            self.counters[tier].current -= nbytes


def copies_meta_to_cpu(func: Any, args: tuple, kwargs: dict | None) -> bool:
    """Whether `func` is a traced step's device-to-host copy: a meta tensor's `.to(cpu)`."""
    device = (kwargs or {}).get("device")
    return (
        func is torch.ops.aten._to_copy.default
        and device is not None
        and torch.device(device).type == "cpu"
        and isinstance(args[0], torch.Tensor)
        and args[0].is_meta
    )


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (nested lists, tuples and dicts): pytree's `tree_leaves`
    without its generality, which was a fifth of a trace's time."""
    found: list[torch.Tensor] = []
    _collect_tensors(tree, found)
    return found


def _collect_tensors(value: Any, found: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect_tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _collect_tensors(item, found)


def plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding `tensor`'s memory: itself, or a wrapper subclass's (DTensor's) inner tensors."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names]
    return [plain for t in inner if isinstance(t, torch.Tensor) for plain in plain_tensors(t)]


SUBTOTALS = (
    "gradients_at_step",
    "pinned_host_peak",
    "expert_params",
)  # parts of other components, never the largest alone


def largest_component(components: dict[str, int], tier: str | None) -> str:
    """'name size' of the largest "device", "host" or "disk" component (None: either), for one-line verdicts."""

    def on(name: str) -> str:
        return "host" if name.startswith("host_") else "disk" if name.startswith("disk_") else "device"

    names = [n for n in components if n not in SUBTOTALS and (tier is None or on(n) == tier)]
    name = max(names, key=lambda n: components[n])
    return f"{name} {human_bytes(components[name])}"
