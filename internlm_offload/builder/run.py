"""A run's components in their order (`build_components`) and the one place a `Trainer` is made (`make_trainer`)."""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from internlm_offload.builder.data import build_evaluator, build_loader, build_metrics_log, check_vocab
from internlm_offload.builder.model import (
    apply_data_parallel,
    apply_memory_plan,
    apply_precision,
    apply_tensor_parallel_plan,
    aux_loss_coefficients,
    build_bare_model,
    builds_on_meta,
    host_the_base,
    pool_router_stats,
    router_bias_update,
    sequence_shard,
    uses_loss_parallel,
)
from internlm_offload.builder.optimizer import build_optimizer, build_scheduler, hybrid_cpu_mask, offload_gradients
from internlm_offload.builder.pipeline import (
    apply_pipeline,
    shard_stages,
    split_for_pipeline,
    trainer_reduction,
)
from internlm_offload.config import RunConfig, experts_over_tensor
from internlm_offload.config.mtp import mtp_depth
from internlm_offload.data import StepLoader, build_tokenizer
from internlm_offload.engine.checkpoint import CheckpointManager
from internlm_offload.engine.evaluation import Evaluator
from internlm_offload.engine.expert_load import ExpertLoad
from internlm_offload.engine.loss_scaler import DynamicLossScaler
from internlm_offload.engine.metrics import MetricsLog
from internlm_offload.engine.pipeline import PipelineRunner, PipelineStages
from internlm_offload.engine.pipeline_split import stage_blocks
from internlm_offload.engine.precision import NoMasters, PrecisionPolicy
from internlm_offload.engine.router_bias import RouterBiasUpdate
from internlm_offload.engine.runtime import RunContext, set_determinism
from internlm_offload.engine.sequence_parallel import SequenceShard, apply_sequence_parallel
from internlm_offload.engine.start_plan import checkpoint_folder
from internlm_offload.engine.tensor_parallel import align_grads_in_backward
from internlm_offload.engine.trainer import Trainer, TrainerSettings
from internlm_offload.family import capabilities
from internlm_offload.features import MemoryFeature
from internlm_offload.offload import ActivationOffloader
from internlm_offload.offload.hosted_base import HostedBase
from internlm_offload.offload.selective_offload import SelectiveOffloader
from internlm_offload.optim.grad_offload import GradOffload
from internlm_offload.optim.interface import OffloadOptimizer
from internlm_offload.optim.muon_rule import MUON
from internlm_offload.optim.records import Masters


@dataclass
class Components:
    """What a training step runs: the model, its masters and optimizer, and the memory features' hooks."""

    model: nn.Module
    masters: Masters  # GradOffload wraps the masters when gradients live on the host
    policy: PrecisionPolicy
    optimizer: OffloadOptimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    offloader: ActivationOffloader | None
    selective_offloader: SelectiveOffloader | None
    layers: nn.ModuleList  # the decoder blocks the layer plan acted on
    sequence_shard: SequenceShard | None = None  # isp: this rank's chunk of every sequence
    pipeline: PipelineRunner | None = None  # this rank's pipeline stages' schedule
    hosted_base: HostedBase | None = None  # model.lora.base_on_host: the frozen block linears on the host
    router_bias: RouterBiasUpdate | None = None  # the noaux_tc routers' once-a-step bias update
    aux_loss_coefficients: dict[str, float] = field(default_factory=dict)  # each auxiliary loss's weight, by name

    @property
    def features(self) -> list[MemoryFeature]:
        """The run's memory features in teardown order: the offloaders' and gradient offload's hooks and
        pools, then the optimizer."""
        hooks = [self.offloader, self.selective_offloader, self.hosted_base]
        if isinstance(self.masters, GradOffload):
            hooks.append(self.masters)
        expert_load = ExpertLoad(self.layers)
        monitors = [expert_load] if expert_load.moes else []
        if self.router_bias is not None:
            monitors.append(self.router_bias)
        return [*(feature for feature in hooks if feature is not None), self.optimizer, *monitors]


def build_components(
    cfg: RunConfig,
    ctx: RunContext,
    *,
    check_model: Callable[[nn.Module], None] | None = None,
    check_host_memory: bool = True,
) -> Components:
    """The run's model, masters, memory features, optimizer and schedule, one named step each, in this order.
    `check_model` runs on the bare model; the planner passes `check_host_memory=False` (it predicts the host)."""
    policy = PrecisionPolicy.from_config(cfg.model.dtype, cfg.mixed_precision.master_weights)
    on_meta = builds_on_meta(cfg, policy) and ctx.pipeline_size == 1  # a pipeline cuts the whole seed-built model
    model = build_bare_model(cfg, ctx, on_meta=on_meta, check_model=check_model)
    aux_coefficients = aux_loss_coefficients(cfg, model)
    pool_router_stats(ctx, model)
    shard = sequence_shard(cfg, ctx)
    if shard is None and ctx.tensor_size > 1:  # before the masters exist: they copy the DTensor shards
        apply_tensor_parallel_plan(cfg, ctx, model)
    chunks = split_for_pipeline(cfg, ctx, model, aux_coefficients) if ctx.pipeline_size > 1 else None
    stepped: nn.Module = model if chunks is None else PipelineStages(chunks)  # a pipeline rank steps its stages
    router_bias = router_bias_update(cfg, ctx, model, held=None if chunks is None else stepped)
    cpu_mask = hybrid_cpu_mask(cfg, stepped)
    kept_masters = apply_precision(cfg, ctx, stepped, policy, cpu_mask)
    if shard is not None:  # isp changes no parameter: after the masters' copy, which holds parameters only
        apply_sequence_parallel(model, shard)
        shard_stages(chunks or {}, shard)  # a pipeline's stages keep this rank's chunk
    elif ctx.tensor_size > 1:  # after the cast (it may swap the parameters), before any other gradient hook
        align_grads_in_backward(model)
    layers: nn.ModuleList = model.layers if chunks is None else stage_blocks(chunks)
    segments = None if chunks is None else [len(chunk.layers) for chunk in chunks.values()]
    offloaders = apply_memory_plan(cfg, layers, ctx.accelerator, segments, ctx.pp_rank)
    if chunks is None:
        model, pipeline = apply_data_parallel(cfg, ctx, model, layers, policy, materialize=on_meta), None
    else:  # each stage in DDP or FSDP2 over its data-parallel ranks, then torch's PipelineStage
        pipeline = apply_pipeline(cfg, ctx, chunks, policy, fp32_reduce=kept_masters is not None, sequence_shard=shard)
        model = stepped
    hosted_base = host_the_base(cfg, ctx, layers)  # after the wrapper: DDP broadcasts rank 0's weights when built
    masters: Masters = NoMasters(model, trainer_reduction(cfg, ctx)) if kept_masters is None else kept_masters
    optimizer = build_optimizer(cfg, masters, ctx.accelerator, cpu_mask=cpu_mask, check_host=check_host_memory)
    if cfg.grad_offload:  # its hooks feed the host gradients the optimizer just built reads
        masters = offload_gradients(cfg, ctx, masters, model)
    scheduler = build_scheduler(cfg, optimizer)
    return Components(
        model,
        masters,
        policy,
        optimizer,
        scheduler,
        *offloaders,
        layers,
        shard,
        pipeline,
        hosted_base,
        router_bias,
        aux_coefficients,
    )


def trainer_settings(
    cfg: RunConfig,
    predicted_device_peak: int | None = None,
    runtime_memory: int = 0,
    work_dir: Path | None = None,
) -> TrainerSettings:
    """`work_dir`: where the run writes (its profiler traces too); None for the planner's traces."""
    return TrainerSettings(
        total_steps=cfg.data.total_steps,
        clip_grad_norm=cfg.hybrid_zero_optimizer.clip_grad_norm,
        unclipped_rules=() if cfg.optimizer.muon.clip_grad else (MUON.name,),
        checkpoint_every=cfg.ckpt.checkpoint_every,
        save_checkpoints=cfg.ckpt.enable_save_ckpt,
        log_every=cfg.monitor.log_every,
        progress_bar=cfg.monitor.progress_bar,
        config=cfg.model_dump(),
        config_fingerprint=cfg.fingerprint(),
        max_skipped_steps=cfg.max_skipped_steps,
        label_smoothing=cfg.loss.label_smoothing,
        valid_every=cfg.data.valid_every,
        skip_batches=tuple(cfg.data.skip_ranges()),
        predicted_device_peak_bytes=predicted_device_peak,
        runtime_memory_bytes=runtime_memory,
        loss_parallel=uses_loss_parallel(cfg),
        aux_chunks=aux_chunks(cfg),
        profile_step=cfg.monitor.profile_step,
        profile_dir=None if work_dir is None else work_dir / "profile",
        mtp_depth=mtp_depth(cfg.model),
        mtp_loss_scaling=cfg.model.mtp_config.loss_scaling_factor if mtp_depth(cfg.model) else 0.0,
    )


def aux_chunks(cfg: RunConfig) -> int:
    """The tensor ranks that each add their own chunk's aux loss to one objective: mtp/msp/fsp's with whole experts
    (engine/moe_tensor_parallel.py); isp's chunks are weighted by the wrapper's mean over every rank instead, and
    experts split over the tensor group (no_tp=False) route every token on every rank: one whole aux loss."""
    tensor = cfg.parallel.tensor
    return tensor.size if experts_over_tensor(cfg) and tensor.mode != "isp" else 1


def build_trainer(
    cfg: RunConfig,
    ctx: RunContext,
    work_dir: Path,
    *,
    predicted_device_peak: int | None = None,
    runtime_memory: int = 0,
) -> Trainer:
    """Build every component of the run described by `cfg`; writes nothing to disk.

    `predicted_device_peak`: the planner's per-rank prediction, logged beside the measured peak, and
    `runtime_memory` the runtime's own device memory (`engine/runtime_memory.py`), logged with them.
    """
    set_determinism(cfg.seed, cfg.deterministic, ctx.accelerator)
    # 0. data first: a bad path or tokenizer fails before any model memory is allocated
    pretokenized = cfg.data.type == "internevo"
    tokenizer = None if pretokenized else build_tokenizer(cfg.data.tokenizer)
    if capabilities(cfg.model.type).config_vocab and tokenizer is not None:
        check_vocab(cfg.model.vocab_size, tokenizer.vocab_size, cfg.data.tokenizer)
    loader = build_loader(cfg, ctx, tokenizer)
    evaluator = build_evaluator(cfg, ctx)

    def check_model(model: nn.Module) -> None:
        if tokenizer is not None:
            check_vocab(model.vocab_size, tokenizer.vocab_size, cfg.data.tokenizer)
        else:  # tokenized data: its ids are checked against the model's vocabulary as packs are built
            loader.dataset.vocab_size = model.vocab_size

    parts = build_components(cfg, ctx, check_model=check_model)
    return make_trainer(
        cfg,
        ctx,
        parts,
        loader=loader,
        checkpoints=CheckpointManager(
            checkpoint_folder(cfg, work_dir), ctx, keep_last=cfg.ckpt.keep_last, skip_frozen=cfg.model.lora is not None
        ),
        metrics=build_metrics_log(cfg, work_dir) if ctx.is_main else None,
        evaluator=evaluator,
        settings=trainer_settings(cfg, predicted_device_peak, runtime_memory, work_dir),
    )


def make_trainer(
    cfg: RunConfig,
    ctx: RunContext,
    parts: Components,
    *,
    trainer_class: type[Trainer] = Trainer,
    loader: StepLoader | None = None,
    checkpoints: CheckpointManager | None = None,
    metrics: MetricsLog | None = None,
    evaluator: Evaluator | None = None,
    settings: TrainerSettings | None = None,
) -> Trainer:
    """The one place a `Trainer` is constructed: the run's (`build_trainer`) and the planner's traced step (no
    data, checkpoints or metrics; `trainer_class` answers the host syncs of a step on meta tensors)."""
    return trainer_class(
        ctx=ctx,
        model=parts.model,
        optimizer=parts.optimizer,
        scheduler=parts.scheduler,
        loader=loader,
        checkpoints=checkpoints,
        metrics=metrics,
        settings=settings or trainer_settings(cfg),
        masters=parts.masters,
        features=parts.features,
        scaler=build_loss_scaler(cfg) if parts.policy.loss_scaling else None,
        evaluator=evaluator,
        sequence_shard=parts.sequence_shard,
        pipeline=parts.pipeline,
        aux_loss_coefficients=parts.aux_loss_coefficients,
    )


def build_loss_scaler(cfg: RunConfig) -> DynamicLossScaler:
    scaler = cfg.grad_scaler
    return DynamicLossScaler(
        scale=scaler.fp16.initial_scale,
        min_scale=scaler.fp16.min_scale,
        max_scale=scaler.max_scale,
        growth_factor=scaler.growth_factor,
        backoff_factor=scaler.backoff_factor,
        growth_interval=scaler.fp16.growth_interval,
        hysteresis=scaler.hysteresis,
    )
