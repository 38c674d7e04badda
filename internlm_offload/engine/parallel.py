"""Data-parallel wrappers: `none`, `ddp` and `fsdp2`, registered in PARALLEL.

Each `apply_*` takes the model and plain arguments and returns the model to train. FSDP2 shards
each decoder block as its own unit (so only one block's parameters are unsharded at a time), then the
root for the embeddings, final norm and head.
"""

import functools
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from internlm_offload.engine.expert_parallel import expert_params, moe_blocks, reduce_expert_grads_in_backward
from internlm_offload.engine.runtime import RunContext, expert_data_mesh
from internlm_offload.log import get_logger
from internlm_offload.optim.dtensor import is_dtensor
from internlm_offload.registry import PARALLEL

logger = get_logger(__name__)


@PARALLEL.register_module(name="none")
def apply_none(model: nn.Module, *, ctx: RunContext) -> nn.Module:
    return model


@PARALLEL.register_module(name="ddp")
def apply_ddp(
    model: nn.Module, *, ctx: RunContext, bucket_cap_mb: int = 25, frozen_apart: Sequence[str] = ()
) -> nn.Module:
    """DDP over the data-parallel ranks. `frozen_apart`: frozen tensors (parameters and buffers) DDP leaves alone, as
    a LoRA base in host memory (DDP wants one device type) or a 4-bit base's scales (DDP would broadcast buffers
    every step); they take no gradient, and every rank drew or loads the same values."""
    device_ids = None if ctx.accelerator.name == "cpu" else [ctx.local_rank]
    experts = [name for name, _ in expert_params(model)] if ctx.expert_mesh is not None else []
    if experts or frozen_apart:  # expert shards differ across "ep": reduced over their own group below, not by DDP
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [*experts, *frozen_apart])
    wrapped = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb)
    if experts:
        reduce_expert_grads_in_backward(
            model, ctx.expert_mesh, ctx.expert_grad_divisor, sync=lambda: wrapped.require_backward_grad_sync
        )
    ignored = f", {len(experts)} expert weights apart" if experts else ""
    ignored += f", {len(frozen_apart)} frozen base tensors apart" if frozen_apart else ""
    logger.info("Applied DDP over %d ranks (bucket %d MB)%s", ctx.world_size, bucket_cap_mb, ignored)
    return wrapped


@PARALLEL.register_module(name="fsdp2")
def apply_fsdp2(
    model: nn.Module,
    *,
    ctx: RunContext,
    layers: Sequence[nn.Module],
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    mixed_precision: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """`mesh`: the data-parallel mesh (the "dp" dim under tensor parallel; default: all ranks).
    `mixed_precision`: fp32 shards stay the masters; all-gathers cast, reduce-scatters stay fp32."""
    mesh = mesh if mesh is not None else init_device_mesh(ctx.accelerator.name, (ctx.world_size,))
    policy = CPUOffloadPolicy(pin_memory=ctx.accelerator.supports_pinned_memory) if cpu_offload else OffloadPolicy()
    shard = dict(mesh=mesh, offload_policy=policy, mp_policy=mixed_precision or MixedPrecisionPolicy())
    if ctx.expert_mesh is not None:
        shard_experts(model, ctx, reshard_after_forward, {**shard, "mesh": expert_data_mesh(ctx.expert_mesh)})
    for block in layers:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **shard)
    # The root keeps its params unsharded after forward: backward needs the head straight away.
    fully_shard(model, reshard_after_forward=False, **shard)
    offload = " with CPU offload policy" if cpu_offload else ""
    # a 2-D mesh is HSDP: shards over its last dim, replicas over its first (isp's weight parallel)
    hsdp = f" (shards over {mesh.size(-1)}, {mesh.size(0)} replicas)" if mesh.ndim == 2 else ""
    logger.info("Applied FSDP2 over %d ranks%s%s: %d blocks + root", mesh.size(), hsdp, offload, len(layers))
    return model


def shard_experts(model: nn.Module, ctx: RunContext, reshard_after_forward: bool, shard: dict[str, Any]) -> None:
    """Expert parallel: each sparse block's experts are their own FSDP2 unit over the expert-data dim (the ranks
    holding the same experts; FSDP2 shards the "ep" DTensors again over it, as it does tensor parallel's), before
    their block takes the rest over all data-parallel ranks. Under expert weight parallel the mesh is 2-D (HSDP):
    sharded over groups of `parallel.expert_weight.size`, all-reduced across the replicas. Their reduction divides
    by the ranks whose losses the step averages (`RunContext.expert_grad_divisor`: the data-parallel ranks; all
    under isp), not the expert-data size: the experts' gradients already sum the tokens of their "ep" group's ranks
    (with mtp/msp/fsp's whole experts the expert-data group spans the tensor ranks, so its sum adds their chunks)."""
    for moe in moe_blocks(model):
        fully_shard(moe.experts, reshard_after_forward=reshard_after_forward, **shard)
        moe.experts.set_gradient_divide_factor(float(ctx.expert_grad_divisor))
        if shard["mesh"].size() > 1:
            # a sum, then the division: a factor other than the group's size is PREMUL_SUM otherwise, which gloo
            # lacks. A group of one (expert parallel over every rank) communicates nothing, and there torch 2.13
            # divides the gradient when it copies it and again after, so it is left out (measured: Qwen3-Next EP 2 on
            # 2 ranks under FSDP2 had the experts' gradients halved, grad norm 1.3e-2 off at step 1)
            moe.experts.set_force_sum_reduction_for_comms(True)
    blocks = moe_blocks(model)
    local = tuple(blocks[0].experts.w1.to_local().shape) if blocks else ()
    mesh = shard["mesh"]
    hsdp = f" (shards over {mesh.size(-1)}, {mesh.size(0)} replicas)" if mesh.ndim == 2 else ""
    offload = " with CPU offload policy" if isinstance(shard["offload_policy"], CPUOffloadPolicy) else ""
    logger.info(
        "Applied FSDP2 to the experts over %d expert-data ranks%s%s (w1 here: %s)", mesh.size(), hsdp, offload, local
    )


def buffers_to(model: nn.Module, device: torch.device) -> None:
    """Move every buffer of `model` (not its parameters) to `device`."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(device)


def materialize_shards(model: nn.Module, ctx: RunContext, *, on_host: bool = False) -> None:
    """Allocate a meta-built, sharded model (FSDP2, alone or over tensor parallel's DTensors) on the device
    (`on_host`: in host memory, where FSDP2's CPU offload policy keeps the shards) and initialize this rank's
    shards as the slices of the weights a one-process build draws from the same seed.

    Each parameter is drawn whole on the device, one at a time in the model's own draw order
    (`init_weights`), and only this rank's part of it kept: the process generator advances exactly as in the
    whole build, so every rank, every layout and the one-process run start from one model, on cpu and on
    devices alike. The price is one whole parameter's memory above the shards while it is drawn.
    """
    if ctx.device.type != "meta":
        # The memory planner's trace stays on meta: FSDP2 re-pads a shard only off meta, so to_empty(meta)
        # would leave each parameter's old padded shard alive beside the new one.
        model.to_empty(device=torch.device("cpu") if on_host else ctx.device)
    model.init_weights(apply=functools.partial(init_from_whole, device=ctx.device))
    if on_host and ctx.device.type != "meta":
        buffers_to(model, ctx.device)  # FSDP2 moves the shards it manages, never the buffers (RoPE's frequencies)
    logger.info("Materialized and initialized this rank's shards (meta build)")


@torch.no_grad()
def init_from_whole(param: torch.Tensor, init: Callable[[torch.Tensor], Any], *, device: torch.device) -> None:
    """Run `init` on a whole fp32 tensor of `param`'s global shape on `device` and keep this rank's part in `param`
    (a DTensor's local shard, whatever its mesh and placements; a plain tensor whole). fp32 as the whole build
    draws: a LoRA base cast to the compute dtype before sharding gets the draw rounded, as the cast rounds it."""
    whole = torch.empty(param.shape, dtype=torch.float32, device=device)
    init(whole)
    copy_part(param, whole)


@torch.no_grad()
def copy_part(param: torch.Tensor, whole: torch.Tensor) -> None:
    """Keep this rank's part of `whole` (of `param`'s global shape, any dtype: cast by the copy, as a whole copy
    casts it) in `param`: a DTensor's local shard, whatever its mesh and placements; a plain tensor whole."""
    if is_dtensor(param):
        # src_data_rank=None: every rank holds the same whole tensor, so each cuts its own part, no communication
        part = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(part)
    else:
        param.copy_(whole)
