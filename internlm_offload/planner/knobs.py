"""The planner's search space: a list of knobs, each with its values and the settings those values need.

A knob turns the settings built so far into more: each one times each of the knob's values (`cross`), or,
for a knob that only some settings take, those ones with it on beside all of them with it off
(`_with_knob`). A value carries every option it needs (parameter offload sets FSDP2 where the config leaves
the wrapper open). A knob the config fixes contributes its fixed value; one it leaves "auto" (or every
knob, for `tools/plan`) contributes all of them.

Knobs sit on one of three axes, by what their cost depends on (`search.py`'s step time is separable):
- `MICRO_BATCH`: a micro-batch's time and activation memory (recompute, activation offload, the
  micro-batch shape);
- `OPTIMIZER`: the optimizer step and where its states live (which optimizer, gradient offload, the NVMe
  tier);
- `LAYOUT`: how the ranks split the model (the wrapper, the tensor mode, ...): each value is a search of its own.

To add a knob: write a function from the
settings so far and the `Space` to the new settings, and add a `Knob` to `KNOBS` on its axis. The search
loop does not change.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from internlm_offload.config import AUTO_KNOBS, TENSOR_MODES, RunConfig, data_parallel_size, expert_ranks
from internlm_offload.config.lora import base_on_host_layout_problem
from internlm_offload.config.optimizer import uses_muon
from internlm_offload.config.pipeline import PIPELINE_KNOBS, PIPELINE_MODES, virtual_chunks
from internlm_offload.config.pipeline_partition import rank_blocks
from internlm_offload.family import block_count, routed_experts

MICRO_BATCH, OPTIMIZER, LAYOUT = "micro_batch", "optimizer", "layout"


@dataclass(frozen=True)
class Setting:
    name: str
    options: dict[str, Any]


HYBRID_FRACTIONS = (0.5, 1.0)
PARAMS_ON_HOST = "parallel.fsdp_cpu_offload"  # FSDP2's CPUOffloadPolicy: parameter offload
GRADS_ON_HOST = "grad_offload"  # gradients to the host during backward (with swap or hybrid 1.0)
NVME = "nvme_offload.enable"  # the offloaded optimizer states in files under nvme_offload.path (the NVMe tier)
TENSOR_MODE = "parallel.tensor.mode"
EXPERT_SIZE = "parallel.expert.size"
WRAPPER = "parallel.mode"  # a knob of its own where the config leaves it open: the settings that need FSDP2 set it
BASE_ON_HOST = "model.lora.base_on_host"  # LoRA's frozen base on the host, the trainer's own (none / DDP)
PIPELINE = PIPELINE_KNOBS  # searched as layouts


def activation_settings(num_layers: int, auto: Iterable[str] = AUTO_KNOBS) -> list[Setting]:
    """One activation-memory mechanism at a time, over the `auto` knobs only: no recompute, checkpoint 0.5
    or 1.0, offload of half or all but one of the blocks (never all: the last block is never offloaded, so a pipeline
    rank of one block is offered none). The first setting changes nothing."""
    auto = set(auto)
    recompute, offload = "model.checkpoint" in auto, bool(auto & {"cpu_offloading.enable", "cpu_offloading.num_layers"})
    none = {
        **({"model.checkpoint": 0.0} if recompute else {}),
        **({"cpu_offloading.enable": False, "cpu_offloading.num_layers": 0} if offload else {}),
    }
    settings = [Setting("no recompute" if none else "activations as configured", none)]
    if recompute:
        settings += [Setting(f"checkpoint {c}", {**none, "model.checkpoint": c}) for c in (0.5, 1.0)]
    if offload:
        for blocks in sorted({b for b in (max(1, num_layers // 2), num_layers - 1) if 0 < b < num_layers}):
            settings.append(
                Setting(
                    f"offload {blocks} blocks",
                    {**none, "cpu_offloading.enable": True, "cpu_offloading.num_layers": blocks},
                )
            )
    return settings


def batch_settings(cfg: RunConfig) -> list[Setting]:
    """The configured micro-batch, then each halving of `data.micro_bsz` that divides a rank's samples per
    step: the same global batch in more, smaller micro-batches (less activation memory per micro-batch).
    The first setting changes nothing."""
    data = cfg.data
    per_rank = data.micro_bsz * data.micro_num
    settings = [Setting(f"micro_bsz {data.micro_bsz} x {data.micro_num}", {})]
    size = data.micro_bsz // 2
    while size >= 1:
        if per_rank % size == 0:
            options = {"data.micro_bsz": size, "data.global_bsz": data.global_bsz}
            settings.append(Setting(f"micro_bsz {size} x {per_rank // size}", options))
        size //= 2
    return settings


def optimizer_kinds(
    cfg: RunConfig | None = None, auto: Iterable[str] = AUTO_KNOBS, *, free_wrapper: bool = False
) -> list[Setting]:
    """AdamW, the hybrid optimizer (at each of `HYBRID_FRACTIONS` when its fraction is auto), the swap
    optimizer and, under FSDP2, its CPU offload policy (params, grads and states on the host, AdamW
    stepping there: it excludes the other two), over the `auto` knobs only; what a knob the config fixes
    excludes is left out (`cfg`). `free_wrapper`: the config leaves `parallel.mode` open, so the CPU offload
    policy is tried under any wrapper, its setting switching to FSDP2 (`WRAPPER`), which it needs."""
    auto = set(auto)
    if cfg is not None and cfg.parallel.fsdp_cpu_offload and PARAMS_ON_HOST not in auto:
        return [Setting("optimizer as configured", {})]
    fixed_swap = cfg is not None and cfg.swap_optimizer and "swap_optimizer" not in auto
    fixed_hybrid = cfg is not None and cfg.hybrid_optimizer.enable and "hybrid_optimizer.enable" not in auto
    switch_hybrid = "hybrid_optimizer.enable" in auto and not fixed_swap
    swap = "swap_optimizer" in auto and not fixed_hybrid
    # the wrapper "auto": a layout of its own (`wrapper_settings`), FSDP2's among them, where alone this is built
    wrapper_searched = cfg is not None and WRAPPER in cfg.auto_knobs
    under_fsdp2 = cfg is not None and (cfg.parallel.mode == "fsdp2" or free_wrapper or wrapper_searched)
    # `model.lora.base_on_host` already holds the base on the host, the trainer's way (FSDP2 refuses it)
    hosted = cfg is not None and cfg.model.lora is not None and cfg.model.lora.base_on_host
    # a 4-bit base (QLoRA) is refused under FSDP2, which its CPU offload policy needs
    hosted = hosted or (cfg is not None and cfg.model.quantization_config is not None)
    # nor under a pipeline (refused per stage), nor where the config may choose one
    staged = cfg is not None and (cfg.parallel.pipeline.size > 1 or bool(set(PIPELINE) & set(cfg.auto_knobs)))
    params_on_host = PARAMS_ON_HOST in auto and under_fsdp2 and not (fixed_swap or fixed_hybrid or hosted or staged)
    off = {
        **({"swap_optimizer": False} if swap else {}),
        **({"hybrid_optimizer.enable": False} if switch_hybrid else {}),
        **({PARAMS_ON_HOST: False} if params_on_host else {}),
    }
    settings = [] if fixed_hybrid else [Setting(rule_label(cfg) if off else "optimizer as configured", off)]
    if switch_hybrid or fixed_hybrid:
        fractions = HYBRID_FRACTIONS if "hybrid_optimizer.offload_fraction" in auto else (None,)
        for fraction in fractions:
            options = {
                **off,
                **({"hybrid_optimizer.enable": True} if switch_hybrid else {}),
                **({} if fraction is None else {"hybrid_optimizer.offload_fraction": fraction}),
            }
            label = fraction if fraction is not None else cfg.hybrid_optimizer.offload_fraction if cfg else 0.5
            settings.append(Setting(f"hybrid {label}", options))
    if swap:
        settings.append(Setting("swap", {**off, "swap_optimizer": True}))
    if params_on_host:
        wrapper = {} if cfg.parallel.mode == "fsdp2" or wrapper_searched else {WRAPPER: "fsdp2"}
        settings.append(Setting("params on host (FSDP2)", {**off, **wrapper, PARAMS_ON_HOST: True}))
    return settings


def rule_label(cfg: RunConfig | None) -> str:
    """What the optimizer on the device is called: the rule the config asked for. The settings move where states
    live and never the rule (`optimizer.type` is no knob: Muon against AdamW changes the training, not its memory)."""
    return "Muon" if cfg is not None and uses_muon(cfg.optimizer) else "AdamW"


def _with_gradient_offload(settings: list[Setting], cfg: RunConfig | None, auto: frozenset[str]) -> list[Setting]:
    """`grad_offload` for the settings that step every parameter from host gradients (swap, hybrid 1.0)."""
    if cfg is None:
        return settings
    applies = functools.partial(_steps_all_on_host, cfg=cfg)
    return _with_knob(settings, GRADS_ON_HOST, "grad offload", GRADS_ON_HOST in auto, cfg.grad_offload, applies)


def _with_nvme_tier(settings: list[Setting], cfg: RunConfig | None, auto: frozenset[str]) -> list[Setting]:
    """`nvme_offload.enable` for the settings whose optimizer offloads states (swap, hybrid), where the config
    names a directory."""
    if cfg is None or cfg.nvme_offload.path is None:
        return settings
    applies = functools.partial(_offloads_states, cfg=cfg)
    return _with_knob(settings, NVME, "NVMe", NVME in auto, cfg.nvme_offload.enable, applies)


def _with_knob(
    settings: list[Setting], knob: str, label: str, searched: bool, fixed_on: bool, applies: Callable[[Setting], bool]
) -> list[Setting]:
    """A boolean knob that only some settings take (`applies`). `searched`: every setting with it off, then
    each it applies to with it on (named `+ label`). Else, fixed on: only the settings it applies to; fixed
    off: the settings as they are."""
    if not searched:
        return [s for s in settings if applies(s)] if fixed_on else settings
    without = [Setting(s.name, {**s.options, knob: False}) for s in settings]
    with_it = [Setting(f"{s.name} + {label}", {**s.options, knob: True}) for s in settings if applies(s)]
    return without + with_it


def _offloads_states(setting: Setting, cfg: RunConfig) -> bool:
    """Whether the setting's optimizer keeps states in host memory (swap, or hybrid with a CPU share)."""
    options = setting.options
    if options.get("swap_optimizer", cfg.swap_optimizer):
        return True
    return bool(options.get("hybrid_optimizer.enable", cfg.hybrid_optimizer.enable))


def _steps_all_on_host(setting: Setting, cfg: RunConfig) -> bool:
    """Whether the setting's optimizer steps every parameter from host gradients (what gradient offload needs)."""
    options, hybrid = setting.options, cfg.hybrid_optimizer
    if options.get("swap_optimizer", cfg.swap_optimizer):
        return True
    enabled = options.get("hybrid_optimizer.enable", hybrid.enable)
    return bool(enabled) and options.get("hybrid_optimizer.offload_fraction", hybrid.offload_fraction) == 1.0


def _with_hosted_base(settings: list[Setting], cfg: RunConfig | None, auto: frozenset[str]) -> list[Setting]:
    """`model.lora.base_on_host` for the settings that keep the wrapper none or DDP, on a LoRA run without pipeline
    stages (where `offload/hosted_base.py` is built; FSDP2 holds its base on the host through its own policy, the
    "params on host (FSDP2)" setting)."""
    if cfg is None or BASE_ON_HOST not in auto or not hosted_base_builds(cfg):
        return settings

    def applies(setting: Setting) -> bool:
        options = setting.options
        return options.get(WRAPPER, cfg.parallel.mode) != "fsdp2" and not options.get(PARAMS_ON_HOST, False)

    if not any(applies(s) for s in settings):  # the config's own FSDP2
        return settings
    return _with_knob(settings, BASE_ON_HOST, "base on host", True, False, applies)


def hosted_base_builds(cfg: RunConfig) -> bool:
    """Whether `model.lora.base_on_host` is built for `cfg` apart from its wrapper."""
    return cfg.model.lora is not None and base_on_host_layout_problem(cfg) is None


def tensor_mode_settings(cfg: RunConfig, auto: Iterable[str] = AUTO_KNOBS) -> list[Setting]:
    """Each tensor mode when `parallel.tensor.mode` is searched and tensor groups have several ranks, without a
    pipeline, fixed or searched (under one the mode is not searched: config/resolve.py's NOT_SEARCHED_UNDER_PIPELINE); else one setting
    that changes nothing."""
    staged = cfg.parallel.pipeline.size > 1 or bool(set(PIPELINE) & set(cfg.auto_knobs))  # P fixed or searched
    if TENSOR_MODE not in set(auto) or cfg.parallel.tensor.size == 1 or staged:
        return [Setting("", {})]
    return [Setting(mode, {TENSOR_MODE: mode}) for mode in TENSOR_MODES]


def wrapper_settings(cfg: RunConfig, world_size: int) -> list[Setting]:
    """DDP and FSDP2 (`none` and FSDP2 with one data-parallel rank, where DDP only adds its buckets) when the config
    itself leaves `parallel.mode` "auto": a wrapper decides what every rank holds of the parameters, gradients and
    states, so each is a search of its own (FSDP2's CPU offload policy is an optimizer setting of FSDP2's layout only;
    a wrapper the config cannot take is a refusal line); else one setting that changes nothing. Only the config's
    own "auto" searches it, as `expert_size_settings`."""
    if WRAPPER not in cfg.auto_knobs:
        return [Setting("", {})]
    modes = ("none", "fsdp2") if data_parallel_size(cfg, world_size) == 1 else ("ddp", "fsdp2")
    return [Setting(mode, {WRAPPER: mode}) for mode in modes]


def expert_size_settings(cfg: RunConfig, world_size: int) -> list[Setting]:
    """Each expert-parallel size dividing both the data-parallel ranks and the experts (and, with
    `parallel.expert_weight.size` W > 1, above 1 and leaving expert-data ranks that W divides), when the config itself
    leaves `parallel.expert.size` "auto" (a size moves the experts' bytes and the all-to-all's: each is a search of
    its own); else one setting that changes nothing. Only the config's own "auto" searches it: a tool searching every
    knob would search each size's layout in full."""
    experts = routed_experts(cfg.model)  # a deepseek_v3 model's off its config.json
    if EXPERT_SIZE not in cfg.auto_knobs or not experts:
        return [Setting("", {})]
    data_parallel, weight = expert_ranks(cfg, world_size), cfg.parallel.expert_weight.size

    def takes(size: int) -> bool:
        if data_parallel % size or experts % size:
            return False
        # expert weight groups need expert parallel and must divide the expert-data ranks it leaves (config/resolve.py)
        return weight == 1 or (size > 1 and data_parallel // size % weight == 0)

    return [Setting(f"ep {size}", {EXPERT_SIZE: size}) for size in range(1, data_parallel + 1) if takes(size)]


def pipeline_settings(cfg: RunConfig, world_size: int) -> list[Setting]:
    """Each pipeline layout, when the config itself leaves `parallel.pipeline.size`, `.mode` or `model.num_chunks`
    "auto": sizes dividing the world size (at most one block a stage), each schedule with the chunks it runs (1F1B
    over 1 or 2, ZBH1 over 1, ZBV over 2); a layout the config cannot take is a refusal line of the search. Each is a
    search of its own traces (a pipeline rank holds other blocks and micro-batches in flight); else one setting that
    changes nothing. Only the config's own "auto" searches it, as `expert_size_settings`."""
    auto = set(cfg.auto_knobs) & set(PIPELINE)
    if not auto:
        return [Setting("", {})]
    pipe, layers = cfg.parallel.pipeline, cfg.model.num_layers
    # a fixed `cpu_offloading.num_layers` counts each rank's own blocks: a layout leaving a rank that many or fewer
    # is not offered (the build refuses it)
    offloaded = 0 if "cpu_offloading.num_layers" in cfg.auto_knobs else cfg.cpu_offloading.most_layers
    sizes = [p for p in range(1, world_size + 1) if world_size % p == 0 and p <= layers]
    sizes = sizes if PIPELINE[0] in auto else [pipe.size]
    modes = PIPELINE_MODES if PIPELINE[1] in auto else (pipe.mode,)
    settings = []
    for size in sizes:
        if size == 1:
            settings.append(Setting("no pipeline", dict(zip(PIPELINE, (1, pipe.mode, 1)))))
            continue
        for mode in modes:
            runs = {"1F1B": (1, 2), "ZBH1": (1,), "ZBV": (2,)}[mode] if PIPELINE[2] in auto else (cfg.model.num_chunks,)
            for chunks in runs:
                if offloaded and offloaded >= _fewest_or_inf(layers, size, mode, chunks):
                    continue
                interleaved = f" x {chunks} chunks" if chunks > 1 and mode == "1F1B" else ""
                settings.append(Setting(f"pp {size} {mode}{interleaved}", dict(zip(PIPELINE, (size, mode, chunks)))))
    return settings


def fewest_blocks(cfg: RunConfig) -> int:
    """The blocks of the pipeline rank with the fewest (what `cpu_offloading.num_layers` counts under a pipeline:
    the rank's own); the model's without one."""
    pipe = cfg.parallel.pipeline
    if pipe.size == 1:
        return block_count(cfg.model)
    return rank_blocks_fewest(cfg.model.num_layers, pipe.size, pipe.mode, cfg.model.num_chunks)


def _fewest_or_inf(num_layers: int, size: int, mode: str, num_chunks: int) -> float:
    """`rank_blocks_fewest`, or infinity for a split the config refuses (its refusal line names why)."""
    try:
        return rank_blocks_fewest(num_layers, size, mode, num_chunks)
    except ValueError:
        return float("inf")


def rank_blocks_fewest(num_layers: int, size: int, mode: str, num_chunks: int) -> int:
    """The blocks of the rank with the fewest when `num_layers` are split as the builder splits them."""
    chunks = virtual_chunks(mode, num_chunks)
    return min(len(rank_blocks(num_layers, size, chunks, rank, v_shape=mode == "ZBV")) for rank in range(size))


@dataclass(frozen=True)
class Space:
    """What the knobs read: the config as given, the knobs left to the planner, and the tool's choices."""

    cfg: RunConfig | None
    auto: frozenset[str] = frozenset(AUTO_KNOBS)
    num_layers: int = 0
    free_wrapper: bool = False  # the config names no `parallel.mode`: settings that need FSDP2 may set it
    shapes: bool = False  # also smaller micro-batches of the same global batch (`tools/plan`)
    world_size: int = 1  # the ranks the run will use (expert-parallel sizes divide its data-parallel ones)


@dataclass(frozen=True)
class Knob:
    name: str
    axis: str  # MICRO_BATCH | OPTIMIZER | LAYOUT
    expand: Callable[[list[Setting], Space], list[Setting]]


def cross(settings: list[Setting], values: list[Setting]) -> list[Setting]:
    """Each setting with each value, the values' order outermost (so the first value's settings come first,
    in their order); a value that changes nothing adds nothing to the name."""
    return [Setting(_joined(s.name, v), {**s.options, **v.options}) for v in values for s in settings]


def _joined(name: str, value: Setting) -> str:
    if not name:
        return value.name
    return f"{name}, {value.name}" if value.options else name


def _activations(settings: list[Setting], space: Space) -> list[Setting]:
    return cross(settings, activation_settings(space.num_layers, space.auto))


def _micro_batch_shapes(settings: list[Setting], space: Space) -> list[Setting]:
    return cross(settings, batch_settings(space.cfg)) if space.shapes and space.cfg is not None else settings


def _optimizers(settings: list[Setting], space: Space) -> list[Setting]:
    return cross(settings, optimizer_kinds(space.cfg, space.auto, free_wrapper=space.free_wrapper))


def _gradient_offload(settings: list[Setting], space: Space) -> list[Setting]:
    return _with_gradient_offload(settings, space.cfg, space.auto)


def _nvme_tier(settings: list[Setting], space: Space) -> list[Setting]:
    return _with_nvme_tier(settings, space.cfg, space.auto)


def _hosted_base(settings: list[Setting], space: Space) -> list[Setting]:
    return _with_hosted_base(settings, space.cfg, space.auto)


def _wrappers(settings: list[Setting], space: Space) -> list[Setting]:
    if space.cfg is None:
        return settings
    return cross(settings, wrapper_settings(space.cfg, space.world_size))


def _tensor_modes(settings: list[Setting], space: Space) -> list[Setting]:
    if space.cfg is None:
        return settings
    return cross(settings, tensor_mode_settings(space.cfg, space.auto))


def _expert_sizes(settings: list[Setting], space: Space) -> list[Setting]:
    if space.cfg is None:
        return settings
    return cross(settings, expert_size_settings(space.cfg, space.world_size))


def _pipelines(settings: list[Setting], space: Space) -> list[Setting]:
    if space.cfg is None:
        return settings
    return cross(settings, pipeline_settings(space.cfg, space.world_size))


KNOBS = (
    Knob("activation memory", MICRO_BATCH, _activations),
    Knob("micro-batch shape", MICRO_BATCH, _micro_batch_shapes),
    Knob("optimizer", OPTIMIZER, _optimizers),
    Knob("gradient offload", OPTIMIZER, _gradient_offload),
    Knob("NVMe tier", OPTIMIZER, _nvme_tier),
    Knob("LoRA base on host", OPTIMIZER, _hosted_base),
    Knob("parallel wrapper", LAYOUT, _wrappers),
    Knob("tensor mode", LAYOUT, _tensor_modes),
    Knob("expert parallel size", LAYOUT, _expert_sizes),
    Knob("pipeline", LAYOUT, _pipelines),
)


def search_axes(space: Space) -> tuple[list[Setting], list[Setting], list[Setting]]:
    """The search's layouts, activation settings and optimizer settings for `space` (`search_tensor_modes`' axes;
    each layout's own activation settings: `activations_for`)."""
    return settings_on(LAYOUT, space), settings_on(MICRO_BATCH, space), settings_on(OPTIMIZER, space)


def activations_for(space: Space) -> Callable[[RunConfig], list[Setting]]:
    """The `MICRO_BATCH` axis of each layout: activation offload counts its rank's own blocks under a pipeline."""

    def own(layout: RunConfig) -> list[Setting]:
        if layout.parallel.pipeline.size == 1:
            return settings_on(MICRO_BATCH, space)
        return settings_on(MICRO_BATCH, dataclasses.replace(space, num_layers=fewest_blocks(layout)))

    return own


def settings_on(axis: str, space: Space, knobs: Iterable[Knob] = KNOBS) -> list[Setting]:
    """The settings of one axis: its knobs applied in order to the one setting that changes nothing."""
    settings = [Setting("", {})]
    for knob in knobs:
        if knob.axis == axis:
            settings = knob.expand(settings, space)
    return settings


def optimizer_settings(
    cfg: RunConfig | None = None, auto: Iterable[str] = AUTO_KNOBS, *, free_wrapper: bool = False
) -> list[Setting]:
    """The `OPTIMIZER` axis for `cfg` with the `auto` knobs searched."""
    return settings_on(OPTIMIZER, Space(cfg, frozenset(auto), free_wrapper=free_wrapper))
