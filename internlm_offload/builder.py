"""Config → a ready `Trainer`: the one place that reads the config and wires a run together.

Order matters and is fixed: model → per-layer plan (checkpointing / offload) → parallel wrapping →
optimizer → data → trainer. The memory features are applied to the bare model before data-parallel
wrapping, so FSDP2 shards the same blocks the plan acted on.
"""

import functools
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from internlm_offload.config import ConfigError, CpuOffloadingConfig, ModelConfig, RunConfig
from internlm_offload.data import StepLoader, StepSampler, Tokenizer, build_tokenizer
from internlm_offload.data.validation import find_validation_sets
from internlm_offload.engine.evaluation import Evaluator
from internlm_offload.device import Accelerator
from internlm_offload.device.disk_buffers import DiskSpaceError
from internlm_offload.engine.checkpoint import CheckpointManager
from internlm_offload.engine.start_plan import checkpoint_folder
from internlm_offload.engine.loss_scaler import DynamicLossScaler
from internlm_offload.engine.metrics import MetricsLog
from internlm_offload.engine.parallel import materialize_shards
from internlm_offload.engine.precision import MasterWeights, NoMasters, PrecisionPolicy, cast_model
from internlm_offload.engine.runtime import RunContext, data_parallel_group, env_local_world_size, set_determinism
from internlm_offload.engine.sequence_parallel import SequenceShard, apply_sequence_parallel
from internlm_offload.engine.tensor_parallel import align_grads_in_backward, apply_tensor_parallel
from internlm_offload.engine.trainer import Trainer, TrainerSettings
from internlm_offload.features import MemoryFeature
from internlm_offload.log import get_logger
from internlm_offload.offload import ActivationOffloader, LayerPlan, apply_layer_plan, make_layer_plan
from internlm_offload.offload.plan import LayerMode
from internlm_offload.offload.selective_offload import SelectiveOffloader
from internlm_offload.optim import build_lr_scheduler, param_groups
from internlm_offload.optim.adamw import AdamW, fused_supported
from internlm_offload.optim.grad_offload import GradOffload
from internlm_offload.optim.hybrid import HybridDeviceOptimizer
from internlm_offload.optim.hybrid_host import offload_mask
from internlm_offload.optim.interface import OffloadOptimizer
from internlm_offload.optim.records import Masters
from internlm_offload.optim.swap import SwapAdamW
from internlm_offload.optim.memory import (
    HYBRID_CPU_BYTES,
    SWAP_STATE_BYTES,
    HostMemoryError,
    check_host_memory,
    trainable_elements,
)
from internlm_offload.registry import DATASETS, MODELS, PARALLEL, build
from internlm_offload.config.sizes import human_bytes

logger = get_logger(__name__)


def build_model(cfg: ModelConfig, device: torch.device) -> nn.Module:
    """Construct the model in fp32 on `device`; weights are a pure function of the torch seed.

    The precision policy (`cast_model`) then decides which copy is cast to the compute dtype.
    """
    if cfg.type == "hf_causal_lm":
        kwargs: dict[str, Any] = dict(
            path=cfg.hf_path, config=cfg.hf_config, trust_remote_code=cfg.trust_remote_code, attn_impl=cfg.attn_impl
        )
    else:
        kwargs = dict(
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            num_kv_attention_heads=cfg.num_kv_attention_heads,
            vocab_size=cfg.vocab_size,
            mlp_ratio=cfg.mlp_ratio,
            multiple_of=cfg.multiple_of,
            norm_eps=cfg.norm_eps,
            rope_base=cfg.rope_base,
            tie_word_embeddings=cfg.tie_word_embeddings,
            init_std=cfg.init_std,
            attn_impl=cfg.attn_impl,
            attention_bias=cfg.attention_bias,
        )
    with torch.device(device):
        try:
            return build(MODELS, cfg.type, "model.type", **kwargs)
        except ValueError as exc:  # the HF wrapper names its argument (model.<name>) and the fix
            if cfg.type != "hf_causal_lm":
                raise
            message = " ".join(str(exc).split())
            if message.startswith(("hf_path", "hf_config", "attn_impl")):
                message = f"model.{message}"  # the wrapper's messages start with its argument: a model.* key
            elif not message.startswith("model."):
                message = f"model.type='hf_causal_lm': {message}"
            raise ConfigError(message) from None


def hybrid_cpu_mask(cfg: RunConfig, model: nn.Module) -> list[bool]:
    """Which params, in the optimizer's order (`param_groups`), the hybrid optimizer steps on the CPU (none
    without it). Placed once, before the masters exist: their CPU share lives in host memory."""
    fraction = cfg.hybrid_optimizer.offload_fraction if cfg.hybrid_optimizer.enable else 0.0
    return offload_mask(_optimizer_order(cfg, model), fraction)


def host_master_names(cfg: RunConfig, model: nn.Module, cpu_mask: list[bool]) -> set[str] | None:
    """Names of the fp32 masters kept in host memory: all (None) for the swap optimizer, the hybrid one's CPU
    share (`cpu_mask`) otherwise (none without it)."""
    if cfg.swap_optimizer:
        return None
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)] for p, on_cpu in zip(_optimizer_order(cfg, model), cpu_mask, strict=True) if on_cpu}


def _optimizer_order(cfg: RunConfig, model: nn.Module) -> list[nn.Parameter]:
    return [p for group in param_groups(model, cfg.adam.weight_decay) for p in group["params"]]


def sequence_shard(cfg: RunConfig, ctx: RunContext) -> SequenceShard | None:
    """isp over a tensor group of several ranks: this rank's chunk of every sequence."""
    if cfg.parallel.tensor.mode != "isp" or ctx.mesh is None:
        return None
    tp = ctx.mesh["tp"]
    return SequenceShard(rank=tp.get_local_rank(), size=tp.size(), group=tp.get_group())


def gradient_group(cfg: RunConfig, ctx: RunContext) -> dist.ProcessGroup | None:
    """Whom gradients (and validation sums) are reduced over: the data-parallel dim under mtp/msp/fsp, whose
    tensor ranks hold shards; every rank under isp (None), whose tensor ranks hold chunks of the sequence."""
    return None if cfg.parallel.tensor.mode == "isp" else data_parallel_group(ctx)


def fsdp_mesh(cfg: RunConfig, ctx: RunContext) -> DeviceMesh | None:
    """FSDP2's mesh: the data-parallel dim under mtp/msp/fsp; under isp all ranks, sharded over groups of
    `parallel.weight.size` and replicated across them (InternEvo's weight parallel; HSDP); None: all ranks."""
    if cfg.parallel.tensor.mode != "isp":
        return ctx.mesh["dp"] if ctx.mesh is not None else None
    weight = cfg.parallel.weight.size
    if weight in (1, ctx.world_size):
        return None
    shape = (ctx.world_size // weight, weight)
    return init_device_mesh(ctx.accelerator.name, shape, mesh_dim_names=("replicate", "shard"))


def uses_loss_parallel(cfg: RunConfig) -> bool:
    """Vocab-sharded logits: mtp/msp/fsp with `model.parallel_output` (isp keeps the head whole)."""
    tensor = cfg.parallel.tensor
    return tensor.size > 1 and tensor.mode != "isp" and cfg.model.parallel_output


def builds_on_meta(cfg: RunConfig, policy: PrecisionPolicy) -> bool:
    """Meta build + per-shard init: FSDP2 (tensor parallel included), our own decoder (each parameter drawn whole,
    this rank's part kept), untied embeddings (materializing unties them), and fp32 params (the init happens before
    any cast)."""
    model = cfg.model
    return (
        cfg.parallel.mode == "fsdp2"
        and cfg.parallel.meta_init
        and model.type == "internlm2"
        and not model.tie_word_embeddings
        and policy.param_dtype == torch.float32
    )


def log_build_memory(ctx: RunContext) -> None:
    mib = 2**20
    acc = ctx.accelerator
    logger.info(
        "Model built: %.1f MiB of device memory on this rank (peak %.1f MiB)",
        acc.memory_allocated() / mib,
        acc.max_memory_allocated() / mib,
    )


def build_layer_plan(cfg: RunConfig, num_layers: int) -> LayerPlan:
    offload = cfg.cpu_offloading
    try:
        return make_layer_plan(
            num_layers,
            offload_layers=offload.num_layers,
            checkpoint_ratio=cfg.model.checkpoint,
            selective=cfg.selective_checkpoint,
            selective_offload=cfg.selective_checkpoint_offload,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def offload_settings(section: CpuOffloadingConfig) -> dict[str, Any]:
    """The `cpu_offloading` section as `apply_layer_plan`'s plain keyword arguments."""
    return dict(
        offload_enabled=section.enable,
        mode=section.mode,
        pin_memory=section.pin_memory,
        min_offload_bytes=section.min_offload_bytes,
        prefetch_layers=section.prefetch_layers,
    )


def build_optimizer(
    cfg: RunConfig,
    masters: Masters,
    accelerator: Accelerator,
    *,
    cpu_mask: list[bool] | None = None,
    check_host: bool = True,
) -> OffloadOptimizer:
    """AdamW, or its offloading variants, over the parameters `masters` steps (the fp32 masters where they exist,
    else the model's own through its data-parallel wrapper).

    Every variant gets the same param groups (decay on matrices only) and `fused` choice; the offloading ones the
    masters' records. Host masters (`masters.on_host`) are swapped in with the states (their gradients too with
    `grad_offload`, as host tensors in the records). `cpu_mask`: the hybrid optimizer's placement, when the masters
    were placed by it already (`hybrid_cpu_mask`). `check_host`: refuse states the host memory cannot hold.
    """
    model, host_params = masters.module, masters.on_host
    adam = cfg.adam
    on_disk = cfg.nvme_offload.directory is not None
    if check_host and ((cfg.swap_optimizer and not on_disk) or cfg.hybrid_optimizer.enable):
        check_optimizer_host_memory(cfg, model)
    if check_host and on_disk:
        fraction = 1.0 if cfg.swap_optimizer else cfg.hybrid_optimizer.offload_fraction
        check_nvme_path(cfg.nvme_offload.directory, int(trainable_elements(model) * fraction) * SWAP_STATE_BYTES)
    groups = param_groups(model, adam.weight_decay)
    fused = fused_supported(accelerator.name) if adam.fused is None else adam.fused
    hyper = {"lr": adam.lr, "betas": (adam.adam_beta1, adam.adam_beta2), "eps": adam.adam_eps}
    if cfg.swap_optimizer:
        return build_swap_optimizer(
            groups,
            fused=fused,
            swap_optimizer_times=cfg.swap_optimizer_times,
            use_pinned_optimizer_offload=cfg.use_pinned_optimizer_offload,
            swap_params=host_params,
            host_grads=cfg.grad_offload,
            nvme_path=cfg.nvme_offload.directory,
            records=masters.records(),
            accelerator=accelerator,
            **hyper,
        )
    if cfg.hybrid_optimizer.enable:
        hybrid = cfg.hybrid_optimizer
        # The CPU side keeps the optimizer's default (fused AdamW on cpu); the device side gets the run's choice.
        return HybridDeviceOptimizer(
            groups,
            offload_fraction=hybrid.offload_fraction,
            gpu_optimizer_cls=functools.partial(torch.optim.AdamW, fused=fused),
            param_update_in_fp32=hybrid.param_update_in_fp32,
            overlap_cpu_optimizer_d2h_h2d=hybrid.overlap_cpu_optimizer_d2h_h2d,
            accelerator=accelerator,
            cpu_mask=cpu_mask,
            grads_on_host=cfg.grad_offload,
            nvme_path=cfg.nvme_offload.directory,
            records=masters.records(),
            **hyper,
        )
    return AdamW(groups, fused=fused, **hyper)


def build_swap_optimizer(groups: list[dict[str, Any]], **kwargs: Any) -> SwapAdamW:
    """`SwapAdamW`; with an NVMe path its file is reserved now, and a disk that cannot hold it is a config error."""
    try:
        return SwapAdamW(groups, **kwargs)
    except DiskSpaceError as exc:
        raise ConfigError(f"nvme_offload.path: {exc}") from None


def check_nvme_path(path: str, state_bytes: int) -> None:
    """Refuse before training when the NVMe directory is missing, not writable, or cannot hold this node's
    states (every local rank writes its own files there)."""
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"nvme_offload.path={path!r} is not a writable directory; create it on a local NVMe drive")
    needed = state_bytes * env_local_world_size()
    free = shutil.disk_usage(path).free
    if needed > free:
        raise ConfigError(
            f"nvme_offload.path={path!r} has {human_bytes(free)} free; the offloaded optimizer states of "
            f"{env_local_world_size()} rank(s) on this node need {human_bytes(needed)}"
        )


def check_optimizer_host_memory(cfg: RunConfig, model: nn.Module) -> None:
    """Refuse before training when the host cannot hold the offloaded optimizer states."""
    elements = trainable_elements(model)
    if cfg.swap_optimizer:
        required, what = elements * SWAP_STATE_BYTES, "swap_optimizer (AdamW states on the host)"
    else:
        fraction = cfg.hybrid_optimizer.offload_fraction
        required, what = int(elements * fraction) * HYBRID_CPU_BYTES, "hybrid_optimizer (CPU-stepped params)"
    try:
        check_host_memory(required, what, world_local=env_local_world_size())
    except HostMemoryError as exc:
        raise ConfigError(str(exc)) from None


def check_vocab(model_vocab: int, tokenizer_vocab: int, tokenizer_name: str) -> None:
    if tokenizer_vocab > model_vocab:
        raise ConfigError(
            f"model.vocab_size={model_vocab} is smaller than the tokenizer's vocabulary ({tokenizer_vocab}, "
            f"data.tokenizer={tokenizer_name!r}); set model.vocab_size >= {tokenizer_vocab}"
        )


def build_metrics_log(cfg: RunConfig, work_dir: Path) -> MetricsLog:
    """metrics.jsonl, and TensorBoard beside it when `monitor.tensorboard`; a missing package is a config error."""
    try:
        return MetricsLog(work_dir / "metrics.jsonl", work_dir / "tensorboard" if cfg.monitor.tensorboard else None)
    except ImportError as exc:
        raise ConfigError(str(exc)) from None


def build_loader(cfg: RunConfig, ctx: RunContext, tokenizer: Tokenizer | None) -> StepLoader:
    data = cfg.data
    kwargs: dict[str, Any] = {"seq_len": data.seq_len}
    samples_per_micro_batch = data.micro_bsz
    if data.type in ("internevo", "chat"):
        kwargs.update(micro_bsz=data.micro_bsz, pack_sample_into_one=data.pack_sample_into_one)
        samples_per_micro_batch = 1  # a sample is one pack: the whole micro-batch
    if data.type == "internevo":
        kwargs.update(train_folder=data.train_folder, min_length=data.min_length)
    else:
        kwargs["tokenizer"] = tokenizer
    if data.type in ("text", "chat"):
        kwargs["paths"] = data.paths
    if data.type == "chat":
        kwargs.update(
            chat_template=data.chat_template, max_length=data.max_length, max_bad_fraction=data.max_bad_fraction
        )
    dataset = build(DATASETS, data.type, "data.type", **kwargs)
    sampler = StepSampler(
        len(dataset),
        micro_bsz=samples_per_micro_batch,
        micro_num=data.micro_num,
        rank=ctx.dp_rank,  # a tensor group's ranks read the same micro-batches
        world_size=ctx.dp_size,
        seed=data.seed,
        shuffle=data.shuffle,
    )
    return StepLoader(dataset, sampler)


def build_evaluator(cfg: RunConfig, ctx: RunContext) -> Evaluator | None:
    data = cfg.data
    if data.valid_folder is None:
        return None
    sets = find_validation_sets(data.valid_folder, seq_len=data.seq_len, min_length=data.min_length)
    evaluator = Evaluator(
        sets,
        rank=ctx.dp_rank,
        world_size=ctx.dp_size,
        micro_bsz=data.micro_bsz,
        valid_micro_num=data.valid_micro_num,
        device=ctx.device,
        distributed=ctx.distributed,
        loss_parallel=uses_loss_parallel(cfg),
        group=gradient_group(cfg, ctx),
        sequence_shard=sequence_shard(cfg, ctx),
    )
    for name in evaluator.empty_sets:
        logger.warning("validation set %r has fewer documents than data-parallel ranks; skipped", name)
    return evaluator


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

    @property
    def features(self) -> list[MemoryFeature]:
        """The run's memory features in teardown order: the offloaders' and gradient offload's hooks and
        pools, then the optimizer."""
        hooks = [self.offloader, self.selective_offloader]
        if isinstance(self.masters, GradOffload):
            hooks.append(self.masters)
        return [*(feature for feature in hooks if feature is not None), self.optimizer]


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
    on_meta = builds_on_meta(cfg, policy)
    model = build_bare_model(cfg, ctx, on_meta=on_meta, check_model=check_model)
    shard = sequence_shard(cfg, ctx)
    if shard is None and ctx.tensor_size > 1:  # before the masters exist: they copy the DTensor shards
        apply_tensor_parallel_plan(cfg, ctx, model)
    cpu_mask = hybrid_cpu_mask(cfg, model)
    kept_masters = apply_precision(cfg, ctx, model, policy, cpu_mask)
    if shard is not None:  # isp changes no parameter: after the masters' copy, which holds parameters only
        apply_sequence_parallel(model, shard)
    elif ctx.tensor_size > 1:  # after the cast (it may swap the parameters), before any other gradient hook
        align_grads_in_backward(model)
    layers: nn.ModuleList = model.layers
    offloader, selective_offloader = apply_memory_plan(cfg, layers, ctx.accelerator)
    model = apply_data_parallel(cfg, ctx, model, layers, policy, materialize=on_meta)
    masters: Masters = NoMasters(model) if kept_masters is None else kept_masters
    optimizer = build_optimizer(cfg, masters, ctx.accelerator, cpu_mask=cpu_mask, check_host=check_host_memory)
    if cfg.grad_offload:  # its hooks feed the host gradients the optimizer just built reads
        masters = offload_gradients(cfg, ctx, masters)
    scheduler = build_scheduler(cfg, optimizer)
    return Components(model, masters, policy, optimizer, scheduler, offloader, selective_offloader, layers, shard)


def build_bare_model(
    cfg: RunConfig, ctx: RunContext, *, on_meta: bool, check_model: Callable[[nn.Module], None] | None
) -> nn.Module:
    """The model in fp32 (on meta when FSDP2 materializes the shards later); device memory counts from here."""
    ctx.accelerator.mark_memory_baseline()  # cpu: see device/cpu_memory.py
    model = build_model(cfg.model, torch.device("meta") if on_meta else ctx.device)
    if check_model is not None:
        check_model(model)
    return model


def apply_tensor_parallel_plan(cfg: RunConfig, ctx: RunContext, model: nn.Module) -> None:
    """mtp / msp / fsp over the "tp" mesh dim. fsp's gathers run again in backward where the layer plan leaves a
    block plain (checkpointed blocks keep only their input anyway; offloaded ones move what they save)."""
    plain = build_layer_plan(cfg, len(model.layers)).layers_with(LayerMode.PLAIN)
    apply_tensor_parallel(
        model,
        ctx.mesh["tp"],
        mode=cfg.parallel.tensor.mode,
        parallel_output=cfg.model.parallel_output,
        gather_again_in=set(plain),
    )


def apply_precision(
    cfg: RunConfig, ctx: RunContext, model: nn.Module, policy: PrecisionPolicy, cpu_mask: list[bool]
) -> MasterWeights | None:
    """Cast the model per the precision policy; the fp32 masters it keeps apart, if any. The swap optimizer
    swaps the masters with its states, the hybrid one steps its CPU share on the host: those masters then live
    in (pinned) host memory only."""
    host_names = host_master_names(cfg, model, cpu_mask)
    host_empty = ctx.accelerator.host_empty if host_names is None or host_names else None
    kept = cast_model(
        model,
        policy,
        fsdp=cfg.parallel.mode == "fsdp2",
        host_empty=host_empty,
        host_names=host_names,
        reduce_group=gradient_group(cfg, ctx),
    )
    logger.info("Precision: %s", policy.describe())
    return kept


def apply_memory_plan(
    cfg: RunConfig, layers: nn.ModuleList, accelerator: Accelerator
) -> tuple[ActivationOffloader | None, SelectiveOffloader | None]:
    """The per-block plan (offload / checkpoint / selective / plain) applied to the bare blocks."""
    plan = build_layer_plan(cfg, len(layers))
    logger.info("Layer plan (%d blocks):\n%s", len(layers), plan.table())
    return apply_layer_plan(layers, plan, **offload_settings(cfg.cpu_offloading), accelerator=accelerator)


def apply_data_parallel(
    cfg: RunConfig,
    ctx: RunContext,
    model: nn.Module,
    layers: nn.ModuleList,
    policy: PrecisionPolicy,
    *,
    materialize: bool,
) -> nn.Module:
    """none | ddp | fsdp2 around the model (over the "dp" mesh dim under tensor parallel); a meta-built model's
    shards are materialized and initialised after FSDP2 sharded it."""
    par = cfg.parallel
    mode_args: dict[str, dict[str, Any]] = {
        "none": {},
        "ddp": {"bucket_cap_mb": par.bucket_cap_mb},
        "fsdp2": {
            "layers": layers,
            "mesh": fsdp_mesh(cfg, ctx),
            "reshard_after_forward": par.reshard_after_forward,
            "cpu_offload": par.fsdp_cpu_offload,
            "mixed_precision": policy.fsdp_mixed_precision(),
        },
    }
    wrapper = "none" if cfg.grad_offload and par.mode == "ddp" else par.mode
    if wrapper != par.mode:
        # Gradient offload takes the gradients in backward and reduces them itself; DDP would keep bucket
        # buffers the size of the gradients on the device, unused. Ranks build the same weights from the seed.
        logger.info("DDP: gradient offload reduces the gradients; the model is not wrapped")
    model = build(PARALLEL, wrapper, "parallel.mode", model, ctx=ctx, **mode_args[wrapper])
    if materialize:
        materialize_shards(model, ctx, on_host=par.fsdp_cpu_offload)
    log_build_memory(ctx)
    return model


def build_scheduler(cfg: RunConfig, optimizer: OffloadOptimizer) -> torch.optim.lr_scheduler.LRScheduler:
    schedule = cfg.lr_scheduler
    return build_lr_scheduler(
        optimizer,
        base_lr=cfg.adam.lr,
        warmup_ratio=schedule.warmup_ratio,
        total_steps=schedule.total_steps,
        eta_min=schedule.eta_min,
        decay=schedule.type,
    )


def offload_gradients(cfg: RunConfig, ctx: RunContext, masters: Masters) -> GradOffload:
    """Gradient offload's hooks on the model's parameters, feeding the host gradients of what `masters` steps.
    Under DDP it averages them over the ranks itself (the model runs unwrapped: `apply_data_parallel`); FSDP2
    reduce-scatters before the hooks see a gradient."""
    return GradOffload(
        masters,
        ctx.accelerator,
        bucket_bytes=int(cfg.grad_offload_bucket_mb * 2**20),
        from_zeros=isinstance(masters, MasterWeights),
        reduce=ctx.distributed and cfg.parallel.mode == "ddp",
    )


def trainer_settings(
    cfg: RunConfig, predicted_device_peak: int | None = None, runtime_memory: int = 0
) -> TrainerSettings:
    return TrainerSettings(
        total_steps=cfg.data.total_steps,
        clip_grad_norm=cfg.hybrid_zero_optimizer.clip_grad_norm,
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
    )


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
    if cfg.model.type == "internlm2" and tokenizer is not None:
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
        checkpoints=CheckpointManager(checkpoint_folder(cfg, work_dir), ctx, keep_last=cfg.ckpt.keep_last),
        metrics=build_metrics_log(cfg, work_dir) if ctx.is_main else None,
        evaluator=evaluator,
        settings=trainer_settings(cfg, predicted_device_peak, runtime_memory),
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
