"""Stand-ins that let the builder's own wiring run a training step without allocating it.

- `PlanningAccelerator`: the cpu accelerator with every tensor on the meta device. Host buffers
  (`host_empty`) are meta tensors the tracker counts as host memory; device buffers are meta tensors
  it counts as device memory; side streams and host workers are the calling thread (a traced step
  has no copies to overlap, and the tracker sees one thread's ops), so every schedule runs in program
  order and events are complete when recorded.
- `fsdp2_on_meta()`: FSDP2 runs on meta tensors over torch's fake process group (its device
  assumptions stood in; the collectives do nothing, shapes are those of `world_size` ranks).
- `fused_optimizers_on_meta()`: torch's fused AdamW kernel has a meta implementation (no temporaries,
  as on the device), but `torch.optim.Adam(W)` refuses meta params in a Python-side device check made
  when it creates a param's state; inside the context the check lets meta through.
- `packed_sequences_on_meta()`: transformers' masks (5.x `masking_utils`) look for packed sequences in the position
  ids with a data-dependent check, which meta tensors cannot answer; the stand-in answers "one sequence a row", as
  the run does for the positions transformers makes itself (where the trainer passes packed positions it also
  passes a mask, so transformers does not look; with flash attention the answer is a (B, T) index, not memory).
- `grouped_mm_on_meta()`: transformers' experts run torch's grouped GEMM in the model's dtype wherever torch has it
  (5.x `integrations/moe.py`: on meta too), and cpu's kernel takes fp32, but torch's meta kernel takes bf16 only:
  inside the stand-in it makes the output of the dtypes cpu's kernel takes as well, of the same shape.
- `flash_attention_on_meta()`: on meta tensors `scaled_dot_product_attention` takes its math path,
  which keeps the (T x T) score matrix for backward; on a device (and on cpu) it takes a flash kernel that keeps the
  output and one log-sum-exp per row. The stand-in calls cpu's flash op, which has a meta kernel,
  with the mask turned additive as the cpu dispatcher does, so the trace saves what the run saves. Values of another
  head dim than the queries' (MLA's: DeepSeek-V3's v 128 wide, q and k 192) take no flash kernel: cpu runs the math
  path (its T x T weights saved), a device SDPA's memory-efficient kernel (q, k, v, the output and the log-sum-exp
  saved; cuDNN's keeps the same); `device_kernels` says which the planned run is on.

What the planner predicts with them is what `memory_allocated()` would show: live tensor bytes, not
the allocator's reserved blocks or the runtime's own memory.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from internlm_offload.device import Accelerator, Stream
from internlm_offload.device.kernels import has_grouped_mm
from internlm_offload.planner.tracker import StorageTracker

META = torch.device("meta")
CPU = torch.device("cpu")


@dataclass(frozen=True)
class PlanningAccelerator(Accelerator):
    """An accelerator whose memory is meta tensors counted by `tracker`; see the module docstring.

    `meta=False` keeps everything else but allocates real cpu tensors: the same step run for real (small
    configs only), which is what the meta trace is tested against.
    """

    tracker: StorageTracker = field(default_factory=StorageTracker, compare=False, repr=False)
    meta: bool = True

    def device(self, local_rank: int = 0) -> torch.device:
        return META if self.meta else CPU

    def current_device(self) -> torch.device:
        return self.device()

    def stream(self, delay_s: float = 0.0) -> Stream:
        return self.current_stream()

    def host_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, pinned: bool = True) -> torch.Tensor:
        with self.tracker.allocating_host(pinned):
            return torch.empty(shape, dtype=dtype, device=self.device())

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device())

    def disk_buffer(self, directory: str, nbytes: int) -> PlannedDiskBuffer:
        with self.tracker.allocating(("disk",)):
            return PlannedDiskBuffer(torch.empty(nbytes, dtype=torch.uint8, device=self.device()))

    def host_worker(self, name: str) -> Executor:
        return InlineExecutor()  # the tracker (a dispatch mode) sees the calling thread's ops only

    def free_device_buffer(self, buffer: torch.Tensor) -> None:
        pass  # the tracker sees the storage go when its last tensor does

    def empty_cache(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def mark_memory_baseline(self) -> None:
        pass  # the tracker counts the storages made inside it

    def memory_allocated(self) -> int:
        return self.tracker.live_bytes("device")

    def max_memory_allocated(self) -> int:
        return self.tracker.peak_bytes("device")

    def reset_peak_memory_stats(self) -> None:
        self.tracker.reset_peaks()


@dataclass
class PlannedDiskBuffer:
    """`DiskBuffer`'s interface over a tensor the tracker counts as disk: no file, nothing to page."""

    tensor: torch.Tensor | None

    def prefetch(self, start: int, nbytes: int) -> None:
        pass

    def write_back(self, start: int, nbytes: int) -> None:
        pass

    def finish_writes(self) -> None:
        pass

    def release(self) -> None:
        self.tensor = None


class InlineExecutor(Executor):
    """Runs each submitted call at once, on the calling thread."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001  handed to whoever reads the future, as a thread pool does
            future.set_exception(exc)
        return future


@contextlib.contextmanager
def packed_sequences_on_meta() -> Iterator[None]:
    """transformers' packed-sequence check answers "none" on meta position ids; see the module docstring. A no-op
    without transformers' `masking_utils` (before 4.53 masks were built without the check)."""
    try:
        masking = importlib.import_module("transformers.masking_utils")
    except ImportError:
        yield
        return
    find = masking.find_packed_sequence_indices

    def on_meta(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if position_ids.device.type == "meta" else find(position_ids)

    masking.find_packed_sequence_indices = on_meta
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = find


@contextlib.contextmanager
def grouped_mm_on_meta() -> Iterator[None]:
    """`aten._grouped_mm` on meta in every dtype cpu's kernel takes; see the module docstring. A patch of the meta
    kernel's shared body, which the registered kernel looks up when called (forward and the backward's products)."""
    registrations = importlib.import_module("torch._meta_registrations")
    common = registrations._meta_grouped_mm_common

    def cpu_dtypes(
        mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: Any, scale_b: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        unscaled = scale_a is None and scale_b is None and mat_a.dtype == mat_b.dtype != torch.bfloat16
        if unscaled and has_grouped_mm(CPU, mat_a.dtype):
            offs = kwargs.get("offs", args[0] if args else None)
            return registrations._create_grouped_mm_output_tensor(mat_a, mat_b, offs, kwargs.get("out_dtype"))
        return common(mat_a, mat_b, scale_a, scale_b, *args, **kwargs)

    registrations._meta_grouped_mm_common = cpu_dtypes
    try:
        yield
    finally:
        registrations._meta_grouped_mm_common = common


@contextlib.contextmanager
def flash_attention_on_meta(device_kernels: bool = False) -> Iterator[None]:
    """`F.scaled_dot_product_attention` on meta tensors takes the flash kernel; see the module docstring.
    `device_kernels`: the planned run is on a device, where values of another head dim than the queries' (MLA's) take
    the memory-efficient kernel; on cpu they take the math path.

    A patch of the function rather than a torch-function mode: activation checkpointing recomputes
    the forward inside backward, where such a mode is not active, and must see the same ops again.
    """
    sdpa = F.scaled_dot_product_attention

    def choose(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if query.device.type != "meta":
            return sdpa(query, key, value, *args, **kwargs)
        if value.shape[-1] == query.shape[-1]:
            return flash_attention(query, key, value, *args, **kwargs)
        # MLA: cpu's flash kernel takes one head dim for q, k and v, so cpu runs the math path, as the meta kernel
        # does (its B x H x T x T weights saved: 4 GiB a block for DeepSeek-V3 at 4096 tokens in bf16); a device
        # runs the memory-efficient kernel, which saves no T x T
        return (efficient_attention if device_kernels else sdpa)(query, key, value, *args, **kwargs)

    F.scaled_dot_product_attention = choose
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA through the flash kernel (grouped-query attention natively, as the cpu kernel takes it)."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return op(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA through the memory-efficient kernel, as a device runs values of another head dim than the queries' (it
    has a meta kernel; fewer kv heads repeated, as SDPA does for it)."""
    heads = query.shape[-3]
    if key.shape[-3] != heads:
        key, value = (t.repeat_interleave(heads // t.shape[-3], dim=-3) for t in (key, value))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
    op = torch.ops.aten._scaled_dot_product_efficient_attention
    return op(query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]


@contextlib.contextmanager
def fsdp2_on_meta() -> Iterator[None]:
    """FSDP2 over meta tensors: its device assumptions, stood in while inside.

    - it puts shards and all-gather buffers on its mesh's device (cpu here, where the fake process
      group lives): they go to meta instead;
    - its lazy init refuses parameters still on meta (and, with the CPU offload policy, anywhere but on
      cpu), which is all a planning trace has;
    - it takes streams and events from `torch.<device type>`: meta's are cpu's, which do nothing, except
      that a stream records a (complete) event: HSDP's all-reduce must hand one over off the cpu;
    - with the CPU offload policy it copies each host shard to the device before the all-gather, a
      no-op from meta to meta: the copy is made on meta, counted as device memory (the shards themselves
      are counted as host memory by the trace, the gradient shards by the tracker's host copies).
    """
    fully_shard_module = importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard")
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    device_of_mesh, validate = fully_shard_module._get_device_from_mesh, FSDPParamGroup._validate_no_meta_params
    validate_on_cpu = FSDPParamGroup._validate_cpu_offload_params
    gather_inputs = FSDPParam.all_gather_inputs

    def copied_to_device(fsdp_param: FSDPParam) -> list[torch.Tensor]:
        inputs = gather_inputs.fget(fsdp_param)
        if not fsdp_param.offload_to_cpu:
            return inputs
        return [torch.empty(t.shape, dtype=t.dtype, device=META).copy_(t) for t in inputs]

    fully_shard_module._get_device_from_mesh = lambda mesh: META
    FSDPParamGroup._validate_no_meta_params = lambda self: None
    FSDPParamGroup._validate_cpu_offload_params = lambda self: None
    FSDPParam.all_gather_inputs = property(copied_to_device)
    torch.meta = _meta_device_module()
    try:
        yield
    finally:
        fully_shard_module._get_device_from_mesh = device_of_mesh
        FSDPParamGroup._validate_no_meta_params = validate
        FSDPParamGroup._validate_cpu_offload_params = validate_on_cpu
        FSDPParam.all_gather_inputs = gather_inputs
        del torch.meta


class _MetaStream(torch.cpu.Stream):
    """cpu's stream, whose `record_event` returns a (complete) event where cpu's returns None."""

    def record_event(self) -> torch.cpu.Event:
        return torch.cpu.Event()


def _meta_device_module() -> types.ModuleType:
    """`torch.meta` for FSDP2's device handle: `torch.cpu` with `_MetaStream` streams."""
    module = types.ModuleType("torch.meta")
    module.__dict__.update(vars(torch.cpu))
    module.Stream = _MetaStream
    return module


@contextlib.contextmanager
def fused_optimizers_on_meta() -> Iterator[None]:
    """Let fused AdamW create states for meta params; see the module docstring."""
    adam_module = importlib.import_module("torch.optim.adam")  # `torch.optim.adam` names the function
    check = adam_module._device_dtype_check_for_fused

    def meta_or_check(param: torch.Tensor, cuda_unsupported: bool = False) -> None:
        if param.device.type != "meta":
            check(param, cuda_unsupported)

    adam_module._device_dtype_check_for_fused = meta_or_check
    try:
        yield
    finally:
        adam_module._device_dtype_check_for_fused = check


@contextlib.contextmanager
def expert_dispatch_on_meta(imbalance: float) -> Iterator[None]:
    """Expert parallel's dispatch over meta tensors: the split sizes its count exchange would bring are assumed
    (`assumed_split_sizes`), and the all-to-alls run on meta, where torch's functional collective makes a receive
    buffer of the assumed rows without a collective. A patch of the method, as `flash_attention_on_meta`'s: a
    forward recomputed in backward must see the same sizes."""
    from internlm_offload.engine.expert_parallel import ExpertDispatch

    call = ExpertDispatch.__call__

    def assumed(self: ExpertDispatch, rows: torch.Tensor, counts: torch.Tensor, experts: Any) -> torch.Tensor:
        if rows.device.type != "meta":
            return call(self, rows, counts, experts)
        sizes = assumed_split_sizes(rows.shape[0], counts.numel(), self.size, imbalance)
        return self.route(rows, counts, experts, *sizes)

    ExpertDispatch.__call__ = assumed
    try:
        yield
    finally:
        ExpertDispatch.__call__ = call


def assumed_split_sizes(rows: int, experts: int, ranks: int, imbalance: float) -> tuple[list[int], list[int]]:
    """Rank 0 as the busiest of `ranks`: it sends its `rows` routed rows spread evenly over the `experts`, and
    receives `imbalance` times the mean (every rank sends `rows`, so the mean is `rows`; at most all of them,
    `ranks` x `rows`), spread evenly over its sources and local experts. Every row is taken as kept: GShard's
    drops are not known on meta, and a rank may send all of them (the trace's assumption without expert parallel
    too)."""
    received = round(min(imbalance, ranks) * rows)
    return _spread(rows, experts), _spread(received, experts)


def _spread(total: int, parts: int) -> list[int]:
    """`total` in `parts` as even as integers go, the remainder on the first."""
    return [total // parts + (i < total % parts) for i in range(parts)]
