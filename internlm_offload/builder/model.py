"""The model steps of a run: build it, split it over the tensor group, cast it per the precision policy, apply the
per-block memory plan and wrap it for data parallelism (each an `apply_*` with plain arguments below the config)."""

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from internlm_offload.builder.optimizer import host_master_names
from internlm_offload.config import ConfigError, CpuOffloadingConfig, ModelConfig, RunConfig
from internlm_offload.config.pipeline import pipeline_rank_blocks
from internlm_offload.config.quantization import compute_dtype_name
from internlm_offload.device import Accelerator
from internlm_offload.engine.expert_parallel import apply_expert_parallel, expert_grad_reduction
from internlm_offload.engine.parallel import copy_part, init_from_whole, materialize_shards
from internlm_offload.engine.precision import MasterWeights, PrecisionPolicy, cast_model
from internlm_offload.engine.router_bias import RouterBiasUpdate
from internlm_offload.engine.router_pool import RouterStatsPool
from internlm_offload.engine.runtime import RunContext, data_parallel_group, stage_data_mesh
from internlm_offload.engine.sequence_parallel import SequenceShard
from internlm_offload.engine.tensor_parallel import apply_tensor_parallel
from internlm_offload.errors import CheckpointError
from internlm_offload.family import aux_loss_coefficients as family_aux_loss_coefficients
from internlm_offload.family import capabilities, check_run, family_spec
from internlm_offload.log import get_logger
from internlm_offload.model.families.hf_causal_lm.routers import RouterTaps
from internlm_offload.model.hooks import PoolsRouterStats
from internlm_offload.model.lora import adapter_parameters, apply_lora, draw_adapters
from internlm_offload.model.moe import BiasBlocks
from internlm_offload.model.mtp import MTP_PREFIX
from internlm_offload.model.name_table import FolderFormat
from internlm_offload.model.quantized import quantize_base
from internlm_offload.offload import ActivationOffloader, LayerPlan, apply_layer_plan, make_layer_plan
from internlm_offload.offload.hosted_base import HostedBase, frozen_linears, hosted_tensors
from internlm_offload.offload.plan import LayerMode
from internlm_offload.offload.selective_offload import SelectiveOffloader
from internlm_offload.registry import MODELS, PARALLEL, build
from internlm_offload.weights.hf_folder import absent_mtp_layers, folder_pieces, read_folder

logger = get_logger(__name__)


def build_model(cfg: ModelConfig, device: torch.device) -> nn.Module:
    """Construct the model of `model.type`'s family in fp32 on `device`; weights are a pure function of the torch
    seed (or the folder's).

    The precision policy (`cast_model`) then decides which copy is cast to the compute dtype. Its auxiliary losses
    come unweighted: `aux_loss_coefficients` says what each weighs. A family that names its folder's tensors
    (`folder_format`) gets `model.hf_path`'s weights read over its seeded ones here (not on meta: the planner's trace).
    """
    model = build(MODELS, cfg.type, "model.type", cfg, device)
    layout = family_spec(cfg.type).module().folder_format(model)
    if layout is not None and cfg.hf_path is not None and device.type != "meta":
        load_folder(Path(cfg.hf_path), layout, model)
    return model


def folder_layout(cfg: ModelConfig) -> FolderFormat | None:
    """The family's `folder_format` of the model `cfg` builds (on meta: no weights drawn or read), adapters aside."""
    model = build_model(cfg.model_copy(update={"lora": None}), torch.device("meta"))
    return family_spec(cfg.type).module().folder_format(model)


def load_folder(folder: Path, layout: FolderFormat, model: nn.Module) -> None:
    """Every parameter and persistent buffer of `model` from the folder, none missing and none left over; a
    multi-token-prediction layer the folder lacks altogether (transformers' save_pretrained drops them) keeps the
    seed's draw, said in one line."""
    weights = read_folder(folder, layout)
    absent = absent_mtp_layers(weights, layout)
    drawn = tuple(f"{MTP_PREFIX}layers.{k}." for k in absent)
    try:
        if drawn:
            left = model.load_state_dict(weights, strict=False)
            missing = [n for n in left.missing_keys if not n.startswith(drawn)]
            if missing or left.unexpected_keys:
                quoted = ", ".join(f'"{name}"' for name in missing) or "none"
                raise RuntimeError(f"Missing key(s) in state_dict: {quoted}. Unexpected key(s): {left.unexpected_keys}")
        else:
            model.load_state_dict(weights)
    except RuntimeError as exc:
        raise CheckpointError(f"{folder}: {' '.join(str(exc).split())[:400]}") from None
    log_loaded(folder, layout, len(weights), absent)


def load_folder_shards(folder: Path, layout: FolderFormat, model: nn.Module) -> None:
    """`load_folder` into a model built on meta, sharded (FSDP2, over tensor or expert parallel's DTensors too) and
    materialized with the seed's draws: the folder read a piece at a time (`folder_pieces`: one tensor, or the experts
    of one stacked tensor) and this rank's part of each copied into its shard, so the host holds this rank's shards
    and one piece, never the whole model. A multi-token-prediction layer the folder lacks keeps the seed's draw."""
    own = state_tensors(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for piece in folder_pieces(folder, layout):
        for name, whole in piece.items():
            target = own.get(name)
            if target is None:
                unexpected.append(name)
                continue
            if whole.shape != target.shape:
                raise CheckpointError(
                    f"{folder}: size mismatch for {name}: shape {list(whole.shape)} in the folder, "
                    f"{list(target.shape)} in the model"
                )
            copy_part(target, whole)
            loaded.add(name)
    absent = absent_mtp_layers(loaded, layout)
    drawn = tuple(f"{MTP_PREFIX}layers.{k}." for k in absent)
    missing = [name for name in own if name not in loaded and not name.startswith(drawn)]
    if missing or unexpected:
        quoted = ", ".join(f'"{name}"' for name in missing) or "none"
        raise CheckpointError(f"{folder}: Missing key(s): {quoted}. Unexpected key(s): {unexpected}"[:400])
    log_loaded(folder, layout, len(loaded), absent)


def state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers by their state-dict names (a DTensor where sharded)."""
    own: dict[str, torch.Tensor] = dict(model.named_parameters())
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                own[f"{prefix}.{name}" if prefix else name] = buffer
    return own


def log_loaded(folder: Path, layout: FolderFormat, count: int, absent: list[int]) -> None:
    logger.info("Loaded %d tensors from %s (%s)", count, folder, layout.table.format)
    if absent:
        logger.warning(
            "%s holds no weights of multi-token-prediction layer(s) %s (model.layers.%d on; a folder transformers "
            "saved never has them): drawn from the seed",
            folder,
            ", ".join(map(str, absent)),
            layout.num_layers + absent[0],
        )


def aux_loss_coefficients(cfg: RunConfig, model: nn.Module) -> dict[str, float]:
    """The weight of each auxiliary loss the (bare) model returns, by name, as its family reads them off the config."""
    return family_aux_loss_coefficients(cfg, model)


def sequence_shard(cfg: RunConfig, ctx: RunContext) -> SequenceShard | None:
    """isp over a tensor group of several ranks: this rank's chunk of every sequence."""
    if cfg.parallel.tensor.mode != "isp" or ctx.mesh is None:
        return None
    tp = ctx.mesh["tp"]
    return SequenceShard(rank=tp.get_local_rank(), size=tp.size(), group=tp.get_group())


def gradient_group(cfg: RunConfig, ctx: RunContext) -> dist.ProcessGroup | None:
    """Whom gradients (and validation sums) are reduced over: the data-parallel dim under mtp/msp/fsp, whose
    tensor ranks hold shards; every rank under isp (None), whose tensor ranks hold chunks of the sequence. Under
    a pipeline the same within this rank's stage (`stage_data_mesh`)."""
    isp = cfg.parallel.tensor.mode == "isp"
    if ctx.pipeline_mesh is not None:
        return stage_data_mesh(ctx, over_tensor=isp).get_group()
    return None if isp else data_parallel_group(ctx)


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
    this rank's part kept), untied embeddings (materializing unties them), fp32 params (the init happens before
    any cast; a LoRA base cast to the compute dtype on meta is drawn in fp32 and rounded, as the whole build's cast
    rounds it; its adapters are drawn after the base, `init_adapters`), and weights drawn from the seed
    (`draws_weights`) or read from `model.hf_path` a tensor at a time into the shards (`load_folder_shards`)
    without adapters (PEFT renames the base's weights the folder is read into)."""
    model = cfg.model
    return (
        cfg.parallel.mode == "fsdp2"
        and cfg.parallel.meta_init
        and capabilities(model.type).init_per_param
        and not model.tie_word_embeddings
        and policy.param_dtype == torch.float32
        and (draws_weights(model) or model.lora is None)
    )


def draws_weights(model: ModelConfig) -> bool:
    """Whether the build draws every weight from the seed: not where `build_model` reads a folder's over them (a meta
    build reads it into the shards after materializing them: `read_folder_into_shards`)."""
    return model.hf_path is None


def read_folder_into_shards(cfg: ModelConfig, model: nn.Module) -> None:
    """`model.hf_path`'s weights into a meta-built model's materialized shards (over the seed's draws, so a layer the
    folder lacks is what the whole build draws); nothing for a model whose weights are all drawn."""
    layout = family_spec(cfg.type).module().folder_format(model)
    if layout is not None and cfg.hf_path is not None:
        load_folder_shards(Path(cfg.hf_path), layout, model)


def log_build_memory(ctx: RunContext) -> None:
    mib = 2**20
    acc = ctx.accelerator
    logger.info(
        "Model built: %.1f MiB of device memory on this rank (peak %.1f MiB)",
        acc.memory_allocated() / mib,
        acc.max_memory_allocated() / mib,
    )


def build_layer_plan(cfg: RunConfig, num_layers: int, pp_rank: int = 0) -> LayerPlan:
    """The plan of `num_layers` blocks: the model's, or under a pipeline pipeline rank `pp_rank`'s own."""
    try:
        return make_layer_plan(
            num_layers,
            offload_layers=cfg.cpu_offloading.layers_on(pp_rank),
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


def hosts_base_from_meta(cfg: RunConfig) -> bool:
    """`model.lora.base_on_host` built on meta (`parallel.meta_init`): the frozen block linears go straight to host
    memory (`draw_base_on_host`). The native decoder only (its `init_weights` draws one weight at a time); QLoRA
    quantizes a built base, a tied embedding unties when materialized, and a base read from `model.hf_path` would be
    drawn from the seed instead: those keep the whole build."""
    model, lora = cfg.model, cfg.model.lora
    return (
        lora is not None
        and lora.base_on_host
        and cfg.parallel.meta_init
        and capabilities(model.type).init_per_param
        and not model.tie_word_embeddings
        and model.quantization_config is None
        and draws_weights(model)
    )


def base_drawn_on_host(cfg: RunConfig, ctx: RunContext) -> bool:
    """Whether `draw_base_on_host` puts the base in host memory at the build (the planner's trace stays on meta)."""
    return hosts_base_from_meta(cfg) and ctx.device.type != "meta"


def build_bare_model(
    cfg: RunConfig, ctx: RunContext, *, on_meta: bool, check_model: Callable[[nn.Module], None] | None
) -> nn.Module:
    """The model in fp32 (on meta when FSDP2 materializes the shards later; the base on the host already with
    `hosts_base_from_meta`); device memory counts from here."""
    ctx.accelerator.mark_memory_baseline()  # cpu: see device/cpu_memory.py
    check_run(cfg)
    hosted = hosts_base_from_meta(cfg)
    on_meta = on_meta or hosted
    model = build_model(cfg.model, torch.device("meta") if on_meta else ctx.device)
    if check_model is not None:
        check_model(model)
    if cfg.model.lora is not None:  # on the fp32 base, before any cast, split or wrapper
        if on_meta:  # PEFT's draws here would land on meta: `init_adapters` draws them after the base's
            with torch.random.fork_rng(devices=[]):
                add_adapters(cfg.model, model)
        else:
            add_adapters(cfg.model, model)
        quantize_the_base(cfg.model, model)
    if base_drawn_on_host(cfg, ctx):
        draw_base_on_host(cfg, ctx, model)
    if ctx.expert_mesh is not None:  # each rank keeps its experts' slice of the seed-built whole
        apply_expert_parallel(model, ctx.expert_mesh)
    return model


def router_bias_update(
    cfg: RunConfig, ctx: RunContext, model: nn.Module, held: nn.Module | None = None
) -> RouterBiasUpdate | None:
    """The once-a-step bias update of a model whose routers pick experts with an `e_score_correction_bias`: a
    transformers model's (its router taps) or a native model's (its sparse blocks with a bias router). `held`: a
    pipeline rank's stages, whose routers it moves (counted in a table of all the model's: moe.BiasBlocks)."""
    taps = getattr(model, "routers", None)
    rows = None
    if isinstance(taps, RouterTaps):
        biases, choices, routers = taps.biases, taps.choices, len(taps.bias_routers)
    else:
        blocks = BiasBlocks(model, held)
        biases, choices, routers, rows = blocks.biases, blocks, blocks.num_rows, blocks.rows
    if not routers:
        return None
    speed = cfg.model.router_bias_update_speed
    if cfg.model.lora is not None and speed > 0:
        # The bias is part of the frozen base, and a LoRA checkpoint holds the adapters alone: a moved bias would be
        # lost on resume and in every export (4.7e-3 of the logits after a few steps of the tiny model).
        logger.info("Router bias: frozen under model.lora (the base stays as loaded); router_bias_update_speed ignored")
        speed = 0.0
    logger.info(
        "Router bias: the e_score_correction_bias of %d routers %s (model.router_bias_update_speed=%g)",
        routers,
        "moves against its experts' load once a step" if speed > 0 else "stays as loaded",
        speed,
    )
    # Pooled over every rank (group None): each holds every router whole (expert parallel shards the experts, tensor
    # parallel keeps a sparse block whole) and routes tokens of its own (the data and expert-data ranks; the tensor
    # ranks' chunks of the sequence under isp and under mtp/msp/fsp with experts), so the sums count each token
    # once and leave every replica of a bias equal with no broadcast. Under a pipeline a router's row is counted by
    # its stage's data-parallel ranks alone (zeros elsewhere): again each token once.
    return RouterBiasUpdate(biases, choices, speed, distributed=ctx.distributed, rows=rows)


def pool_router_stats(ctx: RunContext, model: nn.Module) -> None:
    """Lend a model with a global-batch balancing loss the pool of its router statistics on a distributed run: every
    rank, as the bias update pools its counts (each rank routes tokens of its own; see `router_bias_update`)."""
    if ctx.distributed and isinstance(model, PoolsRouterStats):
        model.stats_pool = RouterStatsPool(group=None)


def build_probe_model(cfg: ModelConfig) -> nn.Module:
    """`build_model` on meta with the run's adapters, without their log line: the kernel probe's copy
    (engine/runtime_memory.py), which must run the kernels the run runs. A LoRA block's frozen weights take
    input-gradient-only matmuls and its adapters rank-r ones; oneDNN keeps buffers per kernel shape (4.3 MiB
    more than a fully trained block's for 8 blocks of width 512 in bf16 on cpu)."""
    model = build_model(cfg, torch.device("meta"))
    lora = cfg.lora
    if lora is None:
        return model
    with torch.random.fork_rng(devices=[]):  # PEFT draws A on the cpu before moving it to meta; the run's draws stay
        apply_lora(model, **lora_settings(cfg))
    quantize_the_base(cfg, model, log=False)
    return model


def lora_settings(cfg: ModelConfig) -> dict[str, Any]:
    """`model.lora` as `apply_lora`'s keyword arguments."""
    lora = cfg.lora
    assert lora is not None
    return dict(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout, target_modules=lora_targets(cfg))


def lora_targets(cfg: ModelConfig) -> list[str]:
    """`model.lora.target_modules` as PEFT matches them on this model's family (the config refuses `model.lora` for a
    family without `Capabilities.lora`; one that claims it and names no targets is refused here)."""
    targets = family_spec(cfg.type).entry_function("lora_targets")
    if targets is None:
        raise ConfigError(f"model.lora with model.type={cfg.type!r}: the family names no LoRA targets (lora_targets)")
    return targets(cfg)


def add_adapters(cfg: ModelConfig, model: nn.Module) -> None:
    """PEFT's LoRA layers on the configured targets (the native decoder's names for HF's); the rest frozen."""
    lora = cfg.lora
    targets = lora_targets(cfg)
    try:
        apply_lora(model, **lora_settings(cfg))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    adapters = sum(p.numel() for _, p in adapter_parameters(model))
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    logger.info(
        "LoRA r=%d alpha=%g on %s: %d adapter parameters train, %d frozen",
        lora.r,
        lora.lora_alpha,
        ", ".join(targets),
        adapters,
        frozen,
    )
    if cfg.num_experts:
        logger.info(
            "LoRA on a mixture of experts: the MLP targets adapt the dense blocks and the shared experts; the "
            "routers and the routed experts (%d per sparse block) stay frozen",
            cfg.num_experts,
        )


def quantize_the_base(cfg: ModelConfig, model: nn.Module, *, log: bool = True) -> None:
    """`model.quantization_config`: the blocks' frozen linears held in 4 bits (QLoRA), after the adapters."""
    quant = cfg.quantization_config
    if quant is None:
        return
    dtype_name = compute_dtype_name(cfg)
    count = quantize_base(
        model.layers,
        quant_type=quant.bnb_4bit_quant_type,
        compute_dtype=getattr(torch, dtype_name.removeprefix("torch.")),
        double_quant=quant.bnb_4bit_use_double_quant,
        skip=quant.llm_int8_skip_modules,
    )
    if log:
        logger.info(
            "QLoRA: %d frozen block linears held in 4 bits (%s%s, computed in %s)",
            count,
            quant.bnb_4bit_quant_type,
            ", double quantization" if quant.bnb_4bit_use_double_quant else "",
            dtype_name,
        )


def init_adapters(cfg: ModelConfig, ctx: RunContext, model: nn.Module) -> None:
    """A meta-built LoRA model's adapters after its base: PEFT's draws on a skeleton of the model (the whole
    build injects them after drawing the base, from the same generator), each rank keeping its shards."""
    values = draw_adapters(build_model(cfg, torch.device("meta")), **lora_settings(cfg))
    for name, param in adapter_parameters(model):
        init_from_whole(param, functools.partial(copy_from, values[name]), device=ctx.device)


def draw_base_on_host(cfg: RunConfig, ctx: RunContext, model: nn.Module) -> None:
    """A meta-built LoRA model whose base goes to the host: the blocks' frozen linears (what `HostedBase` holds)
    allocated in host memory at the compute dtype, everything else on the device in fp32; then every weight drawn
    as the whole build draws it (`init_from_whole`: whole, fp32, on the device, one at a time, rounded where it
    lands as the cast would round it) and the adapters after them. The device holds one weight at a time above
    the rest, never the base or the fp32 model."""
    dtype = PrecisionPolicy.from_config(cfg.model.dtype, cfg.mixed_precision.master_weights).compute_dtype
    on_host = {id(t) for t in base_tensors(model.layers)}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in on_host:
                tensor = ctx.accelerator.host_empty(param.shape, dtype)
            else:
                tensor = torch.empty(param.shape, dtype=param.dtype, device=ctx.device)
            module._parameters[name] = nn.Parameter(tensor, requires_grad=param.requires_grad)
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = torch.empty_like(buffer, device=ctx.device)
    model.init_weights(apply=functools.partial(init_from_whole, device=ctx.device))
    init_adapters(cfg.model, ctx, model)
    logger.info("Built on meta: the frozen block weights drawn straight into host memory")


def base_tensors(layers: nn.ModuleList) -> list[torch.Tensor]:
    """The tensors `model.lora.base_on_host` holds on the host: the blocks' frozen linears'."""
    return [t for block in layers for linear in frozen_linears(block) for t in hosted_tensors(linear)]


def frozen_base_names(cfg: RunConfig, ctx: RunContext, model: nn.Module) -> list[str]:
    """The frozen base's tensors (parameters and buffers) DDP leaves alone: a base `draw_base_on_host` put in host
    memory (DDP wants one device type) and a 4-bit base (its scales are buffers DDP would broadcast before every
    forward: a GiB a step at 70B). Every rank draws or loads the same values; they take no gradient."""
    if not (base_drawn_on_host(cfg, ctx) or cfg.model.quantization_config is not None):
        return []
    base = {id(t) for t in base_tensors(model.layers)}
    named = [*model.named_parameters(), *model.named_buffers()]
    return [name for name, tensor in named if id(tensor) in base]


def copy_from(source: torch.Tensor, target: torch.Tensor) -> None:
    target.copy_(source)


def host_the_base(cfg: RunConfig, ctx: RunContext, layers: nn.ModuleList) -> HostedBase | None:
    """`model.lora.base_on_host`: the blocks' frozen linears to host memory, brought in a block at a time."""
    lora = cfg.model.lora
    if lora is None or not lora.base_on_host:
        return None
    hosted = HostedBase(layers, ctx.accelerator, placed=base_drawn_on_host(cfg, ctx))
    logger.info("LoRA base on the host: %.1f MiB of frozen block weights", hosted.host_bytes / 2**20)
    return hosted


def apply_tensor_parallel_plan(cfg: RunConfig, ctx: RunContext, model: nn.Module) -> None:
    """mtp / msp / fsp over the "tp" mesh dim. fsp's gathers run again in backward where the layer plan leaves a
    block plain (checkpointed blocks keep only their input anyway; offloaded ones move what they save). Under a
    pipeline the plan counts this rank's blocks (their global indices in stage order)."""
    staged = ctx.pipeline_size > 1
    blocks = pipeline_rank_blocks(cfg, ctx.pp_rank) if staged else list(range(len(model.layers)))
    plain = build_layer_plan(cfg, len(blocks), ctx.pp_rank).layers_with(LayerMode.PLAIN)
    apply_tensor_parallel(
        model,
        ctx.mesh["tp"],
        mode=cfg.parallel.tensor.mode,
        parallel_output=cfg.model.parallel_output,
        gather_again_in={blocks[i] for i in plain},
        split_experts=not cfg.parallel.expert.no_tp,
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
        reduce_apart=None
        if ctx.expert_mesh is None
        else expert_grad_reduction(model, ctx.expert_mesh, ctx.expert_grad_divisor),
    )
    logger.info("Precision: %s", policy.describe())
    return kept


def apply_memory_plan(
    cfg: RunConfig,
    layers: nn.ModuleList,
    accelerator: Accelerator,
    segments: list[int] | None = None,
    pp_rank: int = 0,
) -> tuple[ActivationOffloader | None, SelectiveOffloader | None]:
    """The per-block plan (offload / checkpoint / selective / plain) applied to the bare blocks; under a
    pipeline `layers` are pipeline rank `pp_rank`'s stages' blocks in stage order, `segments` their count per stage."""
    plan = build_layer_plan(cfg, len(layers), pp_rank)
    logger.info("Layer plan (%d blocks):\n%s", len(layers), plan.table())
    settings = offload_settings(cfg.cpu_offloading)
    return apply_layer_plan(layers, plan, **settings, accelerator=accelerator, segments=segments)


def fsdp_blocks(model: nn.Module, layers: nn.ModuleList) -> list[nn.Module]:
    """FSDP2's units below the root: the blocks, then multi-token prediction's layers (each a block and its norms and
    projection: sharded as a block is, not held whole by the root for the step)."""
    mtp = getattr(model, "mtp", None)
    return [*layers, *(mtp.layers if mtp is not None else ())]


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
        "ddp": {"bucket_cap_mb": par.bucket_cap_mb, "frozen_apart": frozen_base_names(cfg, ctx, model)},
        "fsdp2": {
            "layers": fsdp_blocks(model, layers),
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
        if ctx.device.type != "meta":  # the planner's trace reads no weights
            read_folder_into_shards(cfg.model, model)
        if cfg.model.lora is not None and ctx.device.type != "meta":
            init_adapters(cfg.model, ctx, model)
    log_build_memory(ctx)
    return model
