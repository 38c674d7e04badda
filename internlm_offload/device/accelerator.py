"""The accelerator: the one place that talks to `torch.cuda` / `torch.npu`.

Trainer, offload and optimizer code ask an `Accelerator` for devices, process-group backends, host
buffers, memory statistics, streams and events, so the same code runs on cuda, npu (through
`torch_npu`) and cpu. An accelerator hands each call to its backend: `DeviceBackend` below is a thin
layer over `torch.<name>`; `CpuBackend` (`cpu_streams`) emulates side streams with worker threads and
reads "device memory" from the kernel, strictly enough that a missing wait fails a cpu test.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.profiler

from internlm_offload.device.cpu_checks import ComputeLedger
from internlm_offload.device.cpu_memory import CpuMemory
from internlm_offload.device.cpu_streams import CpuBackend, StreamRegistry
from internlm_offload.device.disk_buffers import DiskBuffer
from internlm_offload.device.host_alloc import REGISTER_MIN_BYTES, registered_empty
from internlm_offload.device.streams import Event, Stream, copy_pairs

# Host tensors take part in collectives too (the norm of host gradients under FSDP2's CPU offload policy
# or gradient offload): a device's group gets gloo beside its own backend for them, as torchtitan does.
BACKENDS = {"cuda": "cuda:nccl,cpu:gloo", "npu": "npu:hccl,cpu:gloo", "cpu": "gloo"}


@dataclass(frozen=True)
class Accelerator:
    """A device type plus the torch module that drives it (`torch.cuda`, `torch.npu`, or none for cpu)."""

    name: str  # "cuda" | "npu" | "cpu"
    # The cpu backend's state (streams, memory readings); not part of equality, hashing or repr.
    _streams: StreamRegistry = field(default_factory=StreamRegistry, init=False, compare=False, repr=False)
    _memory: CpuMemory = field(default_factory=CpuMemory, init=False, compare=False, repr=False)
    _backend: CpuBackend | DeviceBackend = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.name == "npu" and not hasattr(torch, "npu"):
            # torch.npu exists only once torch_npu is imported: import it here rather than fail on first use
            try:
                import torch_npu  # noqa: F401
            except ImportError:
                raise ValueError("Accelerator('npu') needs torch_npu: pip install torch_npu") from None
        if self.name != "cpu" and not hasattr(torch, self.name):
            raise ValueError(
                f"Accelerator({self.name!r}): torch has no {self.name!r} device module; use cuda, npu or cpu"
            )
        backend = CpuBackend(self._streams, self._memory) if self.name == "cpu" else DeviceBackend(self.name)
        object.__setattr__(self, "_backend", backend)

    @property
    def module(self) -> Any:
        """`torch.cuda` / `torch.npu`; None on cpu."""
        return None if self.name == "cpu" else getattr(torch, self.name)

    @property
    def dist_backend(self) -> str:
        return BACKENDS[self.name]

    @property
    def supports_pinned_memory(self) -> bool:
        # Pinning needs a driver; torch raises on a machine without one.
        return self.name != "cpu"

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu") if self.name == "cpu" else torch.device(self.name, local_rank)

    def set_device(self, local_rank: int) -> None:
        self._backend.set_device(local_rank)

    def synchronize(self) -> None:
        """Block until all streams are idle (cpu: every open side stream)."""
        self._backend.synchronize()

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        """What `torch.profiler` records here: host operators, plus the kernels and copies on cuda (npu
        traces need torch_npu's own profiler, so host operators only)."""
        host = torch.profiler.ProfilerActivity.CPU
        return [host, torch.profiler.ProfilerActivity.CUDA] if self.name == "cuda" else [host]

    def manual_seed_all(self, seed: int) -> None:
        self._backend.manual_seed_all(seed)

    def rng_state(self) -> torch.Tensor | None:
        return self._backend.rng_state()

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        self._backend.set_rng_state(state)

    def host_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, pinned: bool = True) -> torch.Tensor:
        """An uninitialised host buffer: page-locked when asked for and supported; on cpu in shared memory.

        On cpu the buffer is mapped from an unlinked file in `SHM_DIR`, so its pages count as `RssShmem`,
        not as the `RssAnon` that `memory_allocated()` reports. It is an ordinary cpu tensor except that
        it cannot be resized past its size and stays shared with children forked after its creation.
        Buffers under `SHM_MIN_BYTES`, and every buffer when `SHM_DIR` is missing, not writable or would
        keep less than `SHM_RESERVE_FRACTION` of its space free, use ordinary memory.

        On cuda a pinned buffer of `REGISTER_MIN_BYTES` or more is ordinary memory registered with the
        driver (`cudaHostRegister`, released with the storage): the caching host allocator behind
        `pin_memory=True` rounds every block up to a power of two, which would pin up to twice the bytes.
        """
        return self._backend.host_empty(torch.Size(shape), dtype, pinned and self.supports_pinned_memory)

    def disk_buffer(self, directory: str, nbytes: int) -> DiskBuffer:
        """`nbytes` of a new file under `directory`, mapped into memory (the NVMe tier; `disk_buffers`)."""
        return DiskBuffer(directory, nbytes)

    def device_memory_bytes(self, local_rank: int = 0) -> int | None:
        """Total memory of the device `local_rank` uses; None on cpu, whose "device" memory is the host's."""
        return self._backend.device_memory_bytes(local_rank)

    def device_count(self) -> int:
        """Devices on this machine (0 on cpu)."""
        return self._backend.device_count()

    def host_worker(self, name: str) -> Executor:
        """A host thread for CPU work that overlaps the device's (the hybrid optimizer's CPU step)."""
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def current_device(self) -> torch.device:
        """The device this process computes on now (`set_device`'s)."""
        return self._backend.current_device()

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of uninitialised memory on the current device, as a flat uint8 tensor.

        Give it back with `free_device_buffer` only once every stream that used it is done (the caller
        waited on their events). On a device this is the caching allocator. On cpu freed blocks are kept
        and handed to the next request they fit (up to twice its size) at once, as the caching allocator
        does: a missing wait before a free then shows up as overwritten data in cpu tests, and
        steady-state steps map no fresh pages.
        """
        return self._backend.device_buffer(nbytes)

    def free_device_buffer(self, buffer: torch.Tensor) -> None:
        """Return a `device_buffer` for reuse (on a device the caching allocator reclaims it once dropped).

        The caller must have made the compute stream wait for every side stream that used the buffer: the
        allocator hands it to the compute stream at once. On cpu a free while a side-stream task using the
        buffer has not finished raises (a missing wait).
        """
        self._backend.free_device_buffer(buffer)

    def empty_cache(self) -> None:
        """Release cached free device memory (cpu: the blocks `free_device_buffer` kept)."""
        self._backend.empty_cache()

    def device_memory_in_use(self) -> int:
        """Bytes in use on this process's device now, by anything (cuda/npu: total less free: the context,
        other processes, this process's allocator); 0 on cpu, whose "device" memory is the host's."""
        return self._backend.device_memory_in_use()

    def memory_kept_by(self, probe: Callable[[], None]) -> int:
        """How much more device memory is in use after `probe` ran than before (cached blocks released):
        what kernels keep after their first use when `probe` runs them and frees its own tensors."""
        return self._backend.memory_kept_by(probe)

    def mark_memory_baseline(self) -> None:
        """Call before building the model: from here on memory readings count what is allocated after
        this point (cpu: also the sampled peak starts, see `cpu_memory`)."""
        self._backend.mark_memory_baseline()

    def memory_allocated(self) -> int:
        """Bytes of tensors on the device now, above the baseline (cpu: malloc's bytes in use; the host
        tier is excluded)."""
        return self._backend.memory_allocated()

    def max_memory_allocated(self) -> int:
        """Peak bytes of tensors on the device since the last reset, above the baseline (cpu: sampled)."""
        return self._backend.max_memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        self._backend.reset_peak_memory_stats()

    def stream(self, delay_s: float = 0.0) -> Stream:
        """A new side stream; on cpu each submitted task first sleeps `delay_s` (test hook for races)."""
        return self._backend.stream(delay_s)

    def current_stream(self) -> Stream:
        """The stream the caller's work runs on (cpu: the calling thread, unless inside `use_stream`)."""
        return self._backend.current_stream()

    def event(self) -> Event:
        """A new event; it counts as complete until first recorded."""
        return self._backend.event()

    @contextmanager
    def use_stream(self, stream: Stream) -> Iterator[Stream]:
        """Make `stream` current for the block.

        On cpu this only changes the default of `current_stream()`, `Event.record()` and `Event.wait()`:
        plain torch ops in the block still run on the calling thread at once; work goes to a side
        stream only through `stream.submit`.
        """
        with self._backend.use_stream(stream):
            yield stream

    @contextmanager
    def check_ordering(self) -> Iterator[ComputeLedger]:
        """cpu only, for tests: raise `OrderingError` when a side-stream task is submitted before its stream
        waited for the compute work that last touched its memory (see `cpu_checks`)."""
        with self._backend.check_ordering() as ledger:
            yield ledger

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """Tell the caching allocator that `stream` uses `tensor`: its memory is not reused before the
        stream's work queued so far has run (cpu: the stream keeps it alive until it is next idle)."""
        self._backend.record_stream(tensor, stream)

    def copy_async(
        self, dst: torch.Tensor | Sequence[torch.Tensor], src: torch.Tensor | Sequence[torch.Tensor], stream: Stream
    ) -> None:
        """`dst.copy_(src)` on `stream`, or pairwise for two sequences (one stream task), and nothing else: no
        wait, no keep-alive, no event (the benches time bare copies with it). Offload code copies through
        `CopyLane`, which does the whole recipe."""
        if isinstance(dst, torch.Tensor):
            stream.submit(dst.copy_, src, non_blocking=True)
        elif dst:
            stream.submit(copy_pairs, list(dst), list(src))

    def close_streams(self) -> None:
        """Stop the worker threads this accelerator started on cpu: side streams and the memory sampler."""
        self._backend.close_streams()


def get_accelerator(name: str = "auto") -> Accelerator:
    """Pick the accelerator: `auto` prefers cuda, then npu, then cpu; a named one must be available."""
    if name == "auto":
        for candidate in ("cuda", "npu"):
            if is_available(candidate):
                return Accelerator(candidate)
        return Accelerator("cpu")
    if not is_available(name):
        raise ValueError(f"device={name!r} is not available on this machine; use 'auto' or 'cpu'")
    return Accelerator(name)


def accelerator_for(tensors: Iterable[torch.Tensor]) -> Accelerator:
    """The accelerator of the device the first of `tensors` lives on; `get_accelerator()` when there are none.

    Host (and meta) tensors get the cpu accelerator: a model built on the host is offloaded by the cpu
    emulation even on a machine with a GPU, rather than treated as already offloaded.
    """
    for tensor in tensors:
        kind = tensor.device.type
        return Accelerator(kind if kind in ("cuda", "npu") else "cpu")
    return get_accelerator()


def is_available(name: str) -> bool:
    if name == "cpu":
        return True
    if name == "npu" and importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  registers torch.npu

    module = getattr(torch, name, None)
    return module is not None and module.is_available()


# ---- cuda / npu: thin calls into `torch.<name>` --------------------------------------------------


class DeviceBackend:
    """What `Accelerator("cuda" | "npu")` does: `torch.<name>`'s streams, events, allocator and generators."""

    def __init__(self, name: str) -> None:
        self.name, self.module = name, getattr(torch, name)
        self._baseline = 0  # bytes allocated at `mark_memory_baseline`

    def __reduce__(self) -> tuple[Callable[..., DeviceBackend], tuple[str]]:
        return DeviceBackend, (self.name,)  # the module object itself does not pickle

    def synchronize(self) -> None:
        self.module.synchronize()

    def set_device(self, local_rank: int) -> None:
        self.module.set_device(local_rank)

    def manual_seed_all(self, seed: int) -> None:
        self.module.manual_seed_all(seed)

    def rng_state(self) -> torch.Tensor | None:
        return self.module.get_rng_state()

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        if state is not None:
            self.module.set_rng_state(state)

    def host_empty(self, shape: torch.Size, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        nbytes = shape.numel() * dtype.itemsize
        if pinned and nbytes >= REGISTER_MIN_BYTES and hasattr(self.module, "cudart"):
            return registered_empty(self.module.cudart(), shape, dtype)
        return torch.empty(shape, dtype=dtype, pin_memory=pinned)

    def device_memory_bytes(self, local_rank: int) -> int | None:
        return int(self.module.get_device_properties(local_rank).total_memory)

    def device_count(self) -> int:
        return int(self.module.device_count())

    def current_device(self) -> torch.device:
        return torch.device(self.name, self.module.current_device())

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.current_device())

    def free_device_buffer(self, buffer: torch.Tensor) -> None:
        pass  # the caching allocator reclaims the block once the last reference is dropped

    def empty_cache(self) -> None:
        self.module.empty_cache()

    def device_memory_in_use(self) -> int:
        free, total = self.module.mem_get_info()
        return int(total - free)

    def memory_kept_by(self, probe: Callable[[], None]) -> int:
        self.module.empty_cache()
        before = self.device_memory_in_use()
        probe()
        self.module.synchronize()
        self.module.empty_cache()
        return max(0, self.device_memory_in_use() - before)

    def mark_memory_baseline(self) -> None:
        self._baseline = int(self.module.memory_allocated())  # workspaces the probe left (cuBLAS)
        # the peak starts here too: the runtime probe's step before the build is not the build's
        self.module.reset_peak_memory_stats()

    def memory_allocated(self) -> int:
        return int(self.module.memory_allocated()) - self._baseline

    def max_memory_allocated(self) -> int:
        return int(self.module.max_memory_allocated()) - self._baseline

    def reset_peak_memory_stats(self) -> None:
        self.module.reset_peak_memory_stats()

    def stream(self, delay_s: float) -> Stream:
        return DeviceStream(self.module.Stream(), self.module)

    def current_stream(self) -> Stream:
        return DeviceStream(self.module.current_stream(), self.module)

    def event(self) -> Event:
        return DeviceEvent(self.module.Event())

    def use_stream(self, stream: Stream) -> Any:
        return self.module.stream(stream.raw)

    def check_ordering(self) -> Any:
        raise RuntimeError("check_ordering() checks the cpu emulation; a device orders its streams itself")

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        tensor.record_stream(stream.raw)

    def close_streams(self) -> None:
        pass  # device streams hold no host thread


class DeviceStream(Stream):
    def __init__(self, raw: Any, module: Any) -> None:
        self.raw, self._module = raw, module

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        # Runs now on the host; the kernels fn launches are enqueued on this stream.
        with self._module.stream(self.raw):
            fn(*args, **kwargs)

    def wait_event(self, event: Event) -> None:
        self.raw.wait_event(event.raw)

    def synchronize(self) -> None:
        self.raw.synchronize()

    def _new_event(self) -> Event:
        return DeviceEvent(self._module.Event())


class DeviceEvent(Event):
    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def record(self, stream: Stream | None = None) -> None:
        self.raw.record(None if stream is None else stream.raw)

    def wait(self, stream: Stream | None = None) -> None:
        self.raw.wait(None if stream is None else stream.raw)

    def synchronize(self) -> None:
        self.raw.synchronize()

    def query(self) -> bool:
        return bool(self.raw.query())
