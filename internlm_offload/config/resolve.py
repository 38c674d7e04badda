"""Resolve a loaded config: InternEvo keys translated, "auto" knobs set aside, the schema validated, then what
depends on the world size derived and checked (the checks that need more than one section's values after
validation live here, next to the schema).
"""

import copy
from typing import Any

from pydantic import ValidationError

from internlm_offload.config.errors import report_problems, schema_at, validation_problem
from internlm_offload.config.file import ConfigError
from internlm_offload.config.internevo import translate
from internlm_offload.config.optimizer import muon_parallel_problem
from internlm_offload.config.pipeline import PIPELINE_KNOBS, data_parallel_problem, micro_batch_problem
from internlm_offload.config.schema import RunConfig
from internlm_offload.config.sections import AUTO, AUTO_KNOBS, TENSOR_MODES
from internlm_offload.family import experts_key, routed_experts


def resolve_config(raw: dict[str, Any], world_size: int = 1) -> RunConfig:
    """Validate a raw config dict, fill defaults and derive the world-size dependent values.

    InternEvo keys are translated first (`internevo.py`); every problem of the config (settings that
    cannot be honoured here, schema errors) comes in one report.
    """
    raw = {k: v for k, v in raw.items() if not _is_constant(k)}
    translation = translate(raw, world_size)
    raw = translation.config
    problems = list(translation.refused)
    auto = take_auto_knobs(raw)
    budget = raw.get("memory_budget")
    if auto and not (isinstance(budget, dict) and budget.get("device") is not None):
        problems.append(
            f"{auto[0]}='auto' needs memory_budget.device, the device memory per rank the planner "
            "may use, e.g. memory_budget=dict(device='40GiB')"
        )
    if "parallel.mode" in auto:
        raw["parallel"]["mode"] = _wrapper_placeholder(raw, world_size, tensor_auto="parallel.tensor.mode" in auto)
    if "parallel.tensor.mode" in auto:
        raw["parallel"]["tensor"]["mode"] = _tensor_mode_placeholder(raw)
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as exc:
        problems += [validation_problem(err, RunConfig) for err in exc.errors()]
    if problems:
        raise ConfigError(report_problems(problems))
    cfg._migration = translation
    cfg._auto_knobs = auto
    _derive_batch(cfg, data_parallel_size(cfg, world_size))
    _check_pipeline(cfg, data_parallel_size(cfg, world_size))
    if cfg.lr_scheduler.total_steps is None:
        cfg.lr_scheduler.total_steps = cfg.data.total_steps
    if cfg.data.seed is None:
        cfg.data.seed = cfg.seed
    if "parallel.fsdp_cpu_offload" in auto and cfg.parallel.mode != "fsdp2" and "parallel.mode" not in auto:
        raise ConfigError(
            f"parallel.fsdp_cpu_offload='auto' needs parallel.mode='fsdp2' (FSDP2's CPU offload policy), "
            f"got {cfg.parallel.mode!r}"
        )
    if "nvme_offload.enable" in auto and cfg.nvme_offload.path is None:
        raise ConfigError("nvme_offload.enable='auto' needs nvme_offload.path, the directory the planner may choose")
    # A 1-process ddp/fsdp2 run is legal (handy to debug the wrappers); several data-parallel ranks need one.
    data_parallel = data_parallel_size(cfg, world_size)
    if cfg.parallel.mode == "none" and data_parallel > 1 and cfg.parallel.tensor.mode != "isp":
        raise ConfigError(
            f"parallel.mode='none' with {data_parallel} data-parallel ranks (world size {world_size}, tensor size "
            f"{cfg.parallel.tensor.size}): use parallel.mode='ddp' or 'fsdp2'"
        )
    _resolve_expert_parallel(cfg, expert_ranks(cfg, world_size))
    parallel = cfg.parallel
    tier = "swap_optimizer" if cfg.swap_optimizer else "hybrid_optimizer" if cfg.hybrid_optimizer.enable else None
    if problem := muon_parallel_problem(cfg.optimizer, parallel.mode, parallel.tensor.size, parallel.expert.size, tier):
        raise ConfigError(problem)
    return cfg


def expert_ranks(cfg: RunConfig, world_size: int) -> int:
    """The ranks expert parallel is carved from, each routing tokens of its own: the data-parallel ranks, or with
    tensor parallel every rank (isp's and, with `parallel.expert.no_tp`, mtp/msp/fsp's tensor ranks route different
    chunks of the sequences; InternEvo's orders too: its expert tensor size is 1 there). With no_tp=False the
    tensor ranks route the same tokens, each computing its slice of every expert: the data-parallel ranks."""
    return world_size if experts_over_tensor(cfg) else data_parallel_size(cfg, world_size)


def experts_over_tensor(cfg: RunConfig) -> bool:
    """Whether each tensor rank routes a sequence chunk of its own: isp, or mtp/msp/fsp on a model with experts
    whole under `parallel.expert.no_tp` (with no_tp=False every tensor rank routes all the tokens, each computing
    its slice of every expert: engine/expert_tensor_parallel.py)."""
    tensor = cfg.parallel.tensor
    whole = tensor.size > 1 and routed_experts(cfg.model) > 0 and cfg.parallel.expert.no_tp
    return tensor.mode == "isp" or whole


def experts_split_over_tensor(cfg: RunConfig) -> bool:
    """Whether every routed expert is split over the tensor group: mtp/msp/fsp at tensor size > 1 on a model with
    experts and InternEvo's `parallel.expert.no_tp=False`."""
    tensor = cfg.parallel.tensor
    return tensor.size > 1 and tensor.mode != "isp" and routed_experts(cfg.model) > 0 and not cfg.parallel.expert.no_tp


def chunked_loss(cfg: RunConfig) -> bool:
    """Whether each tensor rank's loss is its sequence chunk's share (isp), averaged with the others' over every
    rank, where mtp/msp/fsp's tensor ranks compute the one loss of their micro-batches."""
    return cfg.parallel.tensor.mode == "isp"


def _resolve_expert_parallel(cfg: RunConfig, ranks: int) -> None:
    """`parallel.expert.size` <= 0 as InternEvo's -1: min(`ranks`, experts) (said in the log); then what the expert
    mesh over those ranks (`expert_ranks`) needs (one line each, exit 2). Experts split over the tensor group
    (`no_tp=False` under mtp/msp/fsp) take expert parallel over the data-parallel ranks, not expert weight groups."""
    expert, weight, experts = cfg.parallel.expert, cfg.parallel.expert_weight, routed_experts(cfg.model)
    if expert.size <= 0:
        resolved = min(ranks, experts) if experts else 1
        rule = f"min({_ranks_name(cfg)} ranks {ranks}, {experts_key(cfg.model)} {experts}), InternEvo's rule for -1"
        cfg._derived.append(f"parallel.expert.size={expert.size} -> {resolved}: {rule}")
        expert.size = resolved
    ep = expert.size
    # "auto" holds 1 until the planner chose: its sizes are those expert_weight can take (planner/knobs.py)
    if ep == 1 and weight.size > 1 and "parallel.expert.size" not in cfg.auto_knobs:
        raise ConfigError(f"parallel.expert_weight.size={weight.size} needs parallel.expert.size > 1; set 1")
    if ep == 1:
        if problem := _expert_weight_mode_problem(cfg):  # "auto": no size it may choose can take this mode
            raise ConfigError(problem)
        return
    if not experts:
        raise ConfigError(f"parallel.expert.size={ep} needs a mixture-of-experts model (model.num_experts > 0)")
    if experts_split_over_tensor(cfg) and weight.size > 1:
        tensor = cfg.parallel.tensor
        raise ConfigError(
            f"parallel.expert_weight.size={weight.size} with parallel.expert.no_tp=False under parallel.tensor (size "
            f"{tensor.size}, mode {tensor.mode!r}): expert weight groups over experts split on the tensor group are "
            "not built; set parallel.expert_weight.size=1 or parallel.expert.no_tp=True"
        )
    for name, value in ((experts_key(cfg.model), experts), (f"the {_ranks_name(cfg)} size", ranks)):
        if value % ep:
            raise ConfigError(
                f"parallel.expert.size={ep} must divide {name} ({value}): each of the {ep} ranks holds "
                f"{experts}/{ep} experts of every sparse block, over the {_ranks_name(cfg)} ranks; choose a divisor"
            )
    left = ranks // ep
    if left % weight.size:
        raise ConfigError(
            f"parallel.expert_weight.size={weight.size} must divide the expert-data ranks left, "
            f"{_ranks_name(cfg)} {ranks} / expert {ep} = {left}; choose a divisor"
        )
    if problem := _expert_weight_mode_problem(cfg):
        raise ConfigError(problem)


def _expert_weight_mode_problem(cfg: RunConfig) -> str | None:
    weight = cfg.parallel.expert_weight.size
    if weight > 1 and cfg.parallel.mode != "fsdp2" and "parallel.mode" not in cfg.auto_knobs:  # "auto": its search
        return (
            f"parallel.expert_weight.size={weight} shards the experts with FSDP2 over groups of their expert-data "
            f"ranks: set parallel.mode='fsdp2', got {cfg.parallel.mode!r}"
        )
    return None


def _ranks_name(cfg: RunConfig) -> str:
    """What `expert_ranks` counts, for the messages."""
    return "world" if experts_over_tensor(cfg) and cfg.parallel.tensor.size > 1 else "data-parallel"


def data_parallel_size(cfg: RunConfig, world_size: int) -> int:
    """Ranks that read different micro-batches: the world over the tensor groups (tensor ranks innermost)."""
    tensor, pipeline = cfg.parallel.tensor.size, cfg.parallel.pipeline.size
    sizes = (("tensor", tensor), ("weight", cfg.parallel.weight.size), ("pipeline", pipeline))
    for key, size in sizes:
        if size > world_size or world_size % size:
            raise ConfigError(
                f"parallel.{key}.size={size} must divide the world size {world_size} (torchrun --nproc-per-node "
                f"x nodes); choose a size that divides it"
            )
    if world_size % (tensor * pipeline):
        raise ConfigError(
            f"parallel.pipeline.size={pipeline} x parallel.tensor.size={tensor} must divide the world size "
            f"{world_size}: each stage's ranks are whole tensor groups; choose sizes whose product divides it"
        )
    return world_size // (tensor * pipeline)


NOT_SEARCHED_UNDER_PIPELINE = ("parallel.tensor.mode", "parallel.expert.size", "parallel.fsdp_cpu_offload")


def _check_pipeline(cfg: RunConfig, data_parallel: int) -> None:
    """The schedules' rules on the (derived) micro-batches per step and on data parallel within a stage; the "auto"
    knobs the search does not vary under a pipeline (tensor mode, expert size, FSDP2's CPU offload policy)."""
    pipe = cfg.parallel.pipeline
    staged = [k for k in cfg.auto_knobs if k in PIPELINE_KNOBS]
    unsearched = [k for k in cfg.auto_knobs if k in NOT_SEARCHED_UNDER_PIPELINE]
    if unsearched and (pipe.size > 1 or staged):
        raise ConfigError(
            f"{unsearched[0]}='auto' with parallel.pipeline.size={'auto' if staged else pipe.size}: not searched "
            "under a pipeline (not built per stage); give the knob a value"
        )
    if pipe.size == 1:
        return
    problem = micro_batch_problem(pipe.size, pipe.mode, cfg.model.num_chunks, cfg.data.micro_num) or (
        data_parallel_problem(
            pipe.mode, data_parallel, cfg.parallel.mode, cfg.parallel.tensor, cfg.parallel.weight.size
        )
    )
    if problem is not None:
        raise ConfigError(problem)


def _tensor_mode_placeholder(raw: dict[str, Any]) -> str:
    """`parallel.tensor.mode="auto"` holds the first mode the rest of the config can take until the planner
    chose (under DDP or with tied embeddings only isp): the others it tries and names as
    refused. None taking it: mtp, whose problems the report then names."""
    for mode in TENSOR_MODES:
        candidate = copy.deepcopy(raw)
        candidate["parallel"]["tensor"]["mode"] = mode
        if _validates(candidate):
            return mode
    return TENSOR_MODES[0]


def _wrapper_placeholder(raw: dict[str, Any], world_size: int, *, tensor_auto: bool) -> str:
    """`parallel.mode="auto"` holds the first wrapper the rest of the config can take (with the tensor mode's
    placeholder where that is "auto" too) until the planner chose: DDP then FSDP2 on several ranks (`none` cannot
    hold several data-parallel ranks), `none` first on one; the planner's layouts are `knobs.wrapper_settings`.
    None taking it: the first, whose problems the report then names."""
    modes = ("ddp", "fsdp2") if world_size > 1 else ("none", "fsdp2", "ddp")
    for mode in modes:
        candidate = copy.deepcopy(raw)
        candidate["parallel"]["mode"] = mode
        if tensor_auto:
            candidate["parallel"]["tensor"]["mode"] = _tensor_mode_placeholder(candidate)
        if _validates(candidate):
            return mode
    return modes[0]


def _validates(raw: dict[str, Any]) -> bool:
    """Whether the schema takes `raw` (a placeholder's trial: its problems are reported by the real validation)."""
    try:
        RunConfig.model_validate(raw)
    except ValidationError:
        return False
    return True


def take_auto_knobs(raw: dict[str, Any]) -> tuple[str, ...]:
    """Replace `"auto"` values of `AUTO_KNOBS` in `raw` by their schema defaults (the memory features
    off) and return those knobs: the schema validates the rest, the planner chooses them later."""
    auto = []
    for knob in AUTO_KNOBS:
        section, _, key = knob.rpartition(".")
        holder: Any = raw
        for name in section.split(".") if section else ():
            holder = holder.get(name) if isinstance(holder, dict) else None
        if isinstance(holder, dict) and holder.get(key) == AUTO:
            schema = schema_at(RunConfig, section.split(".")) if section else RunConfig
            holder[key] = schema.model_fields[key].default
            auto.append(knob)
    return tuple(auto)


def _derive_batch(cfg: RunConfig, data_parallel: int) -> None:
    data = cfg.data
    if data.global_bsz is None:
        data.global_bsz = data.micro_bsz * data.micro_num * data_parallel
        return
    per_step = data.micro_bsz * data_parallel
    if data.global_bsz % per_step:
        raise ConfigError(
            f"data.global_bsz={data.global_bsz} is not divisible by data.micro_bsz * data-parallel ranks = "
            f"{data.micro_bsz} * {data_parallel}; choose a multiple of {per_step}"
        )
    data.micro_num = data.global_bsz // per_step


def _is_constant(key: str) -> bool:
    """UPPER_CASE top-level names are the config file's own constants (InternEvo style), not keys."""
    return key.isupper() and key != "JOB_NAME"
