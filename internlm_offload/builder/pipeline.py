"""Pipeline parallel from the config: this rank's stages of the seed-built model, their DDP and schedule."""

from collections.abc import Mapping

import torch.distributed as dist
from torch import nn

from internlm_offload.builder.model import log_build_memory, uses_loss_parallel
from internlm_offload.config import RunConfig
from internlm_offload.config.pipeline import splits_backward, stage_sequence_parts, virtual_chunks
from internlm_offload.engine.pipeline import PipelineRunner, schedule_class, wrap_chunks
from internlm_offload.engine.pipeline_split import PipelineChunk, split_model
from internlm_offload.engine.precision import PrecisionPolicy
from internlm_offload.engine.runtime import RunContext, data_parallel_group
from internlm_offload.engine.sequence_parallel import SequenceShard
from internlm_offload.log import get_logger

logger = get_logger(__name__)


def split_for_pipeline(
    cfg: RunConfig, ctx: RunContext, model: nn.Module, aux_coefficients: Mapping[str, float]
) -> dict[int, PipelineChunk]:
    """This rank's stages (InternEvo's partition; ZBV's in a V), by stage index, each carrying its sparse blocks'
    auxiliary losses (weighted by `aux_coefficients`). Under msp, fsp and isp the hidden states between stages are
    this tensor rank's part of the sequence (`PipelineChunk.sequence_parts`)."""
    pipe = cfg.parallel.pipeline
    chunks = virtual_chunks(pipe.mode, cfg.model.num_chunks)
    rank = ctx.pipeline_mesh.get_local_rank("pp")
    stages = split_model(model, pipe.size, chunks, rank, v_shape=pipe.mode == "ZBV", aux_coefficients=aux_coefficients)
    for stage in stages.values():
        stage.sequence_parts = stage_sequence_parts(cfg)
    return stages


def shard_stages(chunks: dict[int, PipelineChunk], shard: SequenceShard) -> None:
    """isp: each stage keeps this rank's chunk of the positions (the first stage of the tokens too)."""
    for chunk in chunks.values():
        chunk.sequence_shard = shard


def trainer_reduction(cfg: RunConfig, ctx: RunContext) -> dist.ProcessGroup | None:
    """The group the trainer averages a pipeline's gradients over where no wrapper or fp32 copy does: the stages of
    a zero-bubble schedule under `parallel.mode='ddp'` (`splits_backward`); None elsewhere."""
    pipe = cfg.parallel.pipeline
    if pipe.size == 1 or cfg.parallel.mode != "ddp" or not splits_backward(pipe.mode) or cfg.grad_offload:
        return None
    return data_parallel_group(ctx)


def apply_pipeline(
    cfg: RunConfig,
    ctx: RunContext,
    chunks: dict[int, PipelineChunk],
    policy: PrecisionPolicy,
    *,
    fp32_reduce: bool = False,
    sequence_shard: SequenceShard | None = None,
) -> PipelineRunner:
    """The stages wrapped (DDP or FSDP2 within a stage's data-parallel ranks, `parallel.mode`) and the runner of
    their schedule. `fp32_reduce`: the fp32 masters average the stage's gradients themselves (as gradient offload
    does), so DDP does not wrap the stages. `sequence_shard` (isp): the wrapper reduces over the stage's tensor
    ranks too, the last stage's loss takes the rank's chunk of the labels."""
    pipe = cfg.parallel.pipeline
    num_chunks = virtual_chunks(pipe.mode, cfg.model.num_chunks)
    num_stages = pipe.size * num_chunks
    par = cfg.parallel
    mode = "none" if par.mode == "ddp" and (fp32_reduce or cfg.grad_offload or splits_backward(pipe.mode)) else par.mode
    modules = wrap_chunks(
        ctx,
        chunks,
        mode=mode,
        bucket_cap_mb=par.bucket_cap_mb,
        reshard_after_forward=par.reshard_after_forward,
        mixed_precision=policy.fsdp_mixed_precision(),
        over_tensor=sequence_shard is not None,
    )
    # isp's wrapper sums the tensor ranks' sequence chunks too
    reduced = ctx.dp_size * (ctx.tensor_size if sequence_shard is not None else 1)
    if mode != par.mode:
        reducer = (
            "gradient offload reduces"
            if cfg.grad_offload
            else "the fp32 masters reduce"
            if fp32_reduce
            else "the trainer (a split backward) reduces"
        )
        wrapper = f", not wrapped: {reducer} the gradients over {reduced} ranks each"
    else:
        wrapper = "" if mode == "none" else f", {mode.upper()} over {reduced} ranks each"
    if ctx.tensor_size > 1:
        wrapper += f", tensor {cfg.parallel.tensor.mode} over {ctx.tensor_size} ranks each"
    logger.info(
        "Pipeline rank %d of %d: stages %s of %d (%s)%s",
        ctx.pipeline_mesh.get_local_rank("pp"),
        pipe.size,
        list(chunks),
        num_stages,
        schedule_class(pipe.mode, num_chunks).__name__,
        wrapper,
    )
    log_build_memory(ctx)
    return PipelineRunner(
        ctx,
        modules,
        num_stages,
        schedule_class(pipe.mode, num_chunks),
        cfg.data.micro_num,
        label_smoothing=cfg.loss.label_smoothing,
        loss_parallel=uses_loss_parallel(cfg),
        sequence_shard=sequence_shard,
    )
