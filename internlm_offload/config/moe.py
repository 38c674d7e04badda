"""The mixture-of-experts keys of the model section: `moe_layer_kwargs` and the checks across the MoE keys."""

from typing import Any, Literal

from pydantic import Field

from internlm_offload.config.base import Section
from internlm_offload.family import capabilities, families_with, family_spec

MOE_TYPES = ("GShard", "Dropless")  # InternEvo's `moe_type`s built here (model/moe.py's too)
# `moe_layer_kwargs` keys that exist for one moe_type only (InternEvo's layer constructors raise TypeError on the
# others; here one line says which type takes them).
GSHARD_ONLY = ("capacity_factor", "min_capacity", "drop_tokens")
DROPLESS_ONLY = (
    "normalize_expert_weights",
    "scoring_func",
    "routed_scaling_factor",
    "aux_loss_by_layer",
    "score_correction_bias",
    "n_group",
    "topk_group",
)


class MoeLayerKwargsConfig(Section):
    capacity_factor: float = Field(
        1.0,
        gt=0,
        description="GShard: each expert takes at most max(ceil(T / E * capacity_factor * top_k), min_capacity) of "
        "this rank's T tokens' choices; the rest are dropped (1st choices before 2nd, earlier tokens first).",
    )
    min_capacity: int = Field(4, ge=1, description="GShard: the capacity's floor.")
    drop_tokens: bool = Field(
        True,
        description="GShard: False computes every choice (no capacity). InternEvo's default fused gating ignores "
        "this key and always drops; here it is honoured, as InternEvo's non-fused gating does.",
    )
    aux_loss_by_layer: bool = Field(
        True,
        description="Dropless: True, InternEvo's per-layer load-balancing loss (1 per layer for a balanced router, "
        "summed); False, transformers' (and InternEvo Qwen's) global loss on statistics pooled over all layers "
        "(about top_k for a balanced router).",
    )
    normalize_expert_weights: bool = Field(
        True,
        description="Dropless: divide the top-k weights by their sum (transformers' `norm_topk_prob`; Mixtral "
        "always). GShard always renormalises the choices it keeps.",
    )
    scoring_func: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="Dropless: router scores; GShard always scores by softmax."
    )
    routed_scaling_factor: float = Field(1.0, gt=0, description="Dropless: the routed weights are multiplied by it.")
    score_correction_bias: bool = Field(
        False,
        description="Dropless, sigmoid scores: DeepSeek-V3's noaux_tc router (transformers' `topk_method='noaux_tc'`, "
        "its `e_score_correction_bias`): a per-expert fp32 bias, zero at the start, saved in checkpoints, is added to "
        "the scores only to choose the top-k; the weights stay the unbiased scores. Once a step it moves by "
        "`model.router_bias_update_speed` against each expert's load (auxiliary-loss-free balancing).",
    )
    n_group: int = Field(
        1,
        ge=1,
        description="Dropless, with `score_correction_bias`: DeepSeek-V3's group-limited routing (transformers' "
        "`n_group`): the experts in `n_group` equal groups, each scored by the sum of its 2 best biased scores; "
        "the top-k are chosen in the `topk_group` best groups only (the others masked with -inf). 1: no groups.",
    )
    topk_group: int = Field(
        1,
        ge=1,
        description="Dropless, with `score_correction_bias`: groups kept per token (transformers' `topk_group`; "
        "DeepSeek-V3: 4 of 8). `topk_group == n_group` keeps every group.",
    )


def check_moe(model: Any) -> None:
    """The model section's InternEvo legacy `moe_use_residual` folded in, and its mixture-of-experts keys checked."""
    if model.moe_use_residual is not None:
        if model.moe_use_residual and "num_shared_experts" not in model.model_fields_set:
            model.num_shared_experts = 1
        model.moe_use_residual = None
    if model.moe_type not in MOE_TYPES:
        raise ValueError(
            f"model.moe_type={model.moe_type!r}: supported here: {', '.join(MOE_TYPES)} (MegaBlock and "
            "MegaBlock-D need GPU-only kernels; Dropless computes the same tokens as MegaBlock-Dropless)"
        )
    if model.num_experts == 0:
        return
    if not capabilities(model.type).native_experts:
        raise ValueError(
            f"model.num_experts={model.num_experts} builds the experts of model.type="
            f"{families_with('native_experts')}; a {model.type!r} model has its own"
        )
    if model.top_k > model.num_experts:
        raise ValueError(f"model.top_k={model.top_k} must be <= model.num_experts={model.num_experts}")
    kwargs = model.moe_layer_kwargs
    foreign = GSHARD_ONLY if model.moe_type == "Dropless" else DROPLESS_ONLY
    for key in foreign:
        # a default is no option taken: a dumped config (checkpoints store one) writes every key
        if getattr(kwargs, key) != type(kwargs).model_fields[key].default:
            owner = "GShard" if key in GSHARD_ONLY else "Dropless"
            raise ValueError(
                f"model.moe_layer_kwargs.{key} is a moe_type='{owner}' option; model.moe_type={model.moe_type!r}"
                " does not take it"
            )
    check_bias_router(model)
    bad = [i for i in model.mlp_only_layers if not 0 <= i < model.num_layers]
    if bad:
        raise ValueError(
            f"model.mlp_only_layers={model.mlp_only_layers}: {bad[0]} is not a block in [0, {model.num_layers})"
        )


def check_bias_router(model: Any) -> None:
    """DeepSeek-V3's router keys: the bias with sigmoid scores only, groups only with the bias, groups that fit."""
    kwargs, key = model.moe_layer_kwargs, "model.moe_layer_kwargs"
    if kwargs.score_correction_bias and kwargs.scoring_func != "sigmoid":
        raise ValueError(
            f"{key}.score_correction_bias=True is DeepSeek-V3's sigmoid router: {key}.scoring_func="
            f"{kwargs.scoring_func!r} must be 'sigmoid'"
        )
    grouped = kwargs.n_group != 1 or kwargs.topk_group != 1
    if grouped and not kwargs.score_correction_bias:
        raise ValueError(
            f"{key}.n_group={kwargs.n_group}, topk_group={kwargs.topk_group}: group-limited routing is DeepSeek-V3's "
            f"noaux_tc router's; set {key}.score_correction_bias=True (and scoring_func='sigmoid')"
        )
    problem = group_problem(model.num_experts, model.top_k, kwargs.n_group, kwargs.topk_group, f"{key}.")
    if problem:
        raise ValueError(problem)


def group_problem(num_experts: int, top_k: int, n_group: int, topk_group: int, prefix: str = "") -> str | None:
    """What is wrong with routing `top_k` of `num_experts` experts within the `topk_group` best of `n_group` groups
    (transformers' names; `prefix` before each key); None if nothing."""
    if n_group < 1 or not 1 <= topk_group <= n_group:
        return f"{prefix}topk_group={topk_group} must be in [1, {prefix}n_group={n_group}]"
    if num_experts % n_group:
        return f"{prefix}n_group={n_group} must divide the {num_experts} experts"
    size = num_experts // n_group
    if topk_group < n_group and size < 2:  # a group scores the sum of its 2 best
        return f"{prefix}n_group={n_group} leaves groups of 1 expert; a group is scored by its 2 best"
    if topk_group * size < top_k:
        return f"{prefix}topk_group={topk_group} groups of {size} experts hold fewer than top_k={top_k}"
    return None


def moe_kwargs(model: Any) -> dict[str, Any]:
    """The model section's `moe_layer_kwargs` for model/moe.py: the keys of its `moe_type` only."""
    foreign = GSHARD_ONLY if model.moe_type == "Dropless" else DROPLESS_ONLY
    return {k: v for k, v in model.moe_layer_kwargs.model_dump().items() if k not in foreign}


def balancing_problem(cfg: Any) -> str | None:
    """What is wrong with the run's `model.balancing_loss` (a RunConfig); None if nothing."""
    kind = cfg.model.balancing_loss
    if kind is None:
        return None
    key = f"model.balancing_loss={kind!r}"
    if not capabilities(cfg.model.type).balancing_loss:
        return f"{key} is built for model.type={families_with('balancing_loss')}; not {cfg.model.type!r}"
    built = family_spec(cfg.model.type).balancing_losses
    if kind not in built:
        return f"{key}: model.type={cfg.model.type!r} computes {' / '.join(map(repr, built))}"
    if "moe_loss_coeff" not in cfg.loss.model_fields_set:
        # its default, 1.0, is InternEvo's per-layer loss's weight: 1000 times XTuner's alpha here
        return (
            f"{key} is weighted by loss.moe_loss_coeff, which is not set: set it (XTuner's BalancingLossConfig alpha "
            "0.001; the DeepSeek-V3 report's sequence-wise alpha 0.0001)"
        )
    if kind == "sequence" and cfg.parallel.tensor.size > 1:
        return (
            f"{key} balances each whole sequence, and parallel.tensor.size={cfg.parallel.tensor.size} routes chunks "
            "of it on each rank; use 'global_batch' or 'micro_batch'"
        )
    return None
