"""Data-parallel wrappers: `none`, `ddp` and `fsdp2`, registered in PARALLEL.

Each `apply_*` takes the model and plain arguments and returns the model to train. FSDP2 shards
each decoder block as its own unit (so only one block's parameters are unsharded at a time), then the
root for the embeddings, final norm and head.
"""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from internlm_offload.engine.runtime import RunContext
from internlm_offload.log import get_logger
from internlm_offload.registry import PARALLEL

logger = get_logger(__name__)


@PARALLEL.register_module(name="none")
def apply_none(model: nn.Module, *, ctx: RunContext) -> nn.Module:
    return model


@PARALLEL.register_module(name="ddp")
def apply_ddp(model: nn.Module, *, ctx: RunContext, bucket_cap_mb: int = 25) -> nn.Module:
    device_ids = None if ctx.accelerator.name == "cpu" else [ctx.local_rank]
    wrapped = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb)
    logger.info("Applied DDP over %d ranks (bucket %d MB)", ctx.world_size, bucket_cap_mb)
    return wrapped


@PARALLEL.register_module(name="fsdp2")
def apply_fsdp2(
    model: nn.Module,
    *,
    ctx: RunContext,
    layers: nn.ModuleList,
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
    for block in layers:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **shard)
    # The root keeps its params unsharded after forward: backward needs the head straight away.
    fully_shard(model, reshard_after_forward=False, **shard)
    offload = " with CPU offload policy" if cpu_offload else ""
    # a 2-D mesh is HSDP: shards over its last dim, replicas over its first (isp's weight parallel)
    hsdp = f" (shards over {mesh.size(-1)}, {mesh.size(0)} replicas)" if mesh.ndim == 2 else ""
    logger.info("Applied FSDP2 over %d ranks%s%s: %d blocks + root", mesh.size(), hsdp, offload, len(layers))
    return model


def buffers_to(model: nn.Module, device: torch.device) -> None:
    """Move every buffer of `model` (not its parameters) to `device`."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(device)


def materialize_shards(model: nn.Module, ctx: RunContext, *, seed: int, on_host: bool = False) -> None:
    """Allocate a meta-built, FSDP2-sharded model on the device (`on_host`: in host memory, where FSDP2's
    CPU offload policy keeps the shards; never all on the device at once) and initialize only this rank's
    shards.

    One rank draws exactly today's weights (the same generator, the same order). Several ranks: on
    devices where DTensor has its own RNG (cuda, npu) the shards come from one global, seeded stream;
    elsewhere (cpu) DTensor draws each shard from the process generator, which is re-seeded per rank so
    that shards differ from each other. Both are deterministic run to run.
    """
    from torch.distributed.tensor._random import is_rng_supported_mesh

    if ctx.device.type != "meta":
        # The memory planner's trace stays on meta: FSDP2 re-pads a shard only off meta, so to_empty(meta)
        # would leave each parameter's old padded shard alive beside the new one.
        model.to_empty(device=torch.device("cpu") if on_host else ctx.device)
    params = list(model.parameters())
    mesh = getattr(params[0], "device_mesh", None) if params else None
    if ctx.world_size > 1 and mesh is not None and not is_rng_supported_mesh(mesh):
        torch.manual_seed(seed + 7919 * ctx.rank)
    with torch.no_grad():
        model.init_weights()
    if on_host and ctx.device.type != "meta":
        buffers_to(model, ctx.device)  # FSDP2 moves the shards it manages, never the buffers (RoPE's frequencies)
    if ctx.world_size > 1:
        torch.manual_seed(seed)  # the rest of the run draws as if the model had been built whole
    logger.info("Materialized and initialized this rank's shards (meta build)")
