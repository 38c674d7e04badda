"""InternEvo's mixture-of-experts model types and keys → the native model's MoE blocks (docs/migrating.md).

InternEvo (develop, 2025) builds four MoE families; each maps onto `model.type='internlm2'` with `num_experts > 0`
and the switches its decoder class hard-codes or defaults:
- INTERNLM_MoE (`Internlm1MoE`): InternLM v1 attention (biases on all four projections), softmax-mixed shared
  experts (`moe_use_residual`);
- MIXTRALMOE (`MixtralMoE`): the class defaults to biases on q, k, v (8x7B_mixtral.py turns them off), softmax-mixed
  shared experts (Mixtral has none);
- QWEN2MOE (`Qwen2Moe`): biases on q, k, v, none on o; shared experts gated by sigmoid(Linear(H, 1));
- QWEN3MOE (`Qwen3Moe`): as QWEN2MOE plus RMSNorm on q and k per head (`use_qk_norm=True`, hard-coded) and
  `head_dim`; its decoder asserts moe_type='Dropless'. Note InternEvo's class defaults `qkv_bias=True`, so
  qwen3_30B_A3B.py, which does not set it, trains with (zero-initialised) q, k, v biases there and here; Hugging
  Face's Qwen3-MoE has none (set model.qkv_bias=False to match it).

Both Qwen families compute one load-balancing loss from all layers' router logits (`aux_loss_by_layer=False`,
the only value their models run with). 57B_qwen2_MoE.py writes moe_type='GShard' though InternEvo's develop
Qwen2-MoE decoder asserts Dropless: it trains here as GShard, as InternEvo's Qwen2-MoE did when that config
shipped (its Qwen2MoE layer built whichever moe_type the config named), with a warning.

The expert-parallel sections (`parallel.expert`, `parallel.expert_weight`) are read as written and resolved with
the world size (config/resolve.py): size -1 as InternEvo does, min(data-parallel ranks, num_experts), where the
run can take expert parallel (docs/parallelism.md).
"""

from __future__ import annotations

from typing import Any

from internlm_offload.config.translation import Translation

MOE_MODEL_TYPES = ("INTERNLM_MoE", "QWEN2MOE", "MIXTRALMOE", "QWEN3MOE")
QWEN_MOE_TYPES = ("QWEN2MOE", "QWEN3MOE")
_ABSENT = object()

# moe_layer_kwargs keys of InternEvo's layers that change nothing in the computation built here (kernel and
# dispatch choices, options of paths not taken), by the value that is what is built.
NO_EFFECT_KWARGS = {
    "use_grouped_mlp": None,  # any value: the experts here are always one grouped GEMM
    "enable_fused_permute": None,  # any value: the permutation kernel
    "token_dispatch_policy": None,  # any value: expert parallel here always exchanges by all-to-all
    "deterministic_mode": None,  # any value: the counts here are deterministic on every device
    "use_fused_gating": True,  # the fused GShard gating is what model/moe.py computes
    "use_rts": None,  # any value: ignored by InternEvo's fused gating (random token selection is non-fused only)
    "drop_policy": None,  # any value: Dropless without a capacity drops nothing
    "moe_jitter_eps": None,  # any value: only read by noisy_gate_policy='Jitter'
    "noisy_gate_policy": (None, "None"),
    "drop_and_pad": False,
}
NO_EFFECT_FIX = {
    "use_fused_gating": "InternEvo's non-fused gating (random token selection, Gumbel noise on the 2nd choice) is "
    "not built here; set True",
    "noisy_gate_policy": "noisy gates are not built here; set None",
    "drop_and_pad": "Dropless with padded capacity is not built here; set False",
}


def _pop(section: dict[str, Any], key: str) -> Any:
    return section.pop(key, _ABSENT)


def map_moe_model(t: Translation, model_type: str) -> None:
    """Rewrite the model (and loss) keys of an InternEvo MoE config for the native MoE blocks."""
    model = t.config.setdefault("model", {})
    if not isinstance(model, dict):
        return
    if t.config.pop("moe", _ABSENT) is not _ABSENT:
        t.refused.append(
            "moe=dict(...): InternEvo's older MoE section is not read; put top_k in model and the layer options in "
            "model.moe_layer_kwargs"
        )
    _family_switches(t, model, model_type)
    experts = model.get("num_experts", _ABSENT)
    if isinstance(experts, int) and not isinstance(experts, bool) and experts <= 1:
        model["num_experts"] = 0  # InternEvo: num_experts <= 1 builds a dense FFN
        t.mapped.append(f"model.num_experts={experts} -> 0: dense blocks (InternEvo's <= 1)")
    first_dense = _pop(model, "first_k_dense_replace")
    if first_dense is not _ABSENT:
        model["mlp_only_layers"] = list(range(int(first_dense)))
        t.mapped.append(f"model.first_k_dense_replace={first_dense} -> model.mlp_only_layers=[0, {first_dense})")
    moe_type = model.get("moe_type", "GShard")
    _qwen_moe_type(t, model_type, moe_type)
    kwargs = model.get("moe_layer_kwargs")
    if isinstance(kwargs, dict):
        _layer_kwargs(t, kwargs, moe_type)
    if model_type in QWEN_MOE_TYPES and moe_type == "Dropless":
        _qwen_global_aux_loss(t, model, model_type)
    loss = t.config.setdefault("loss", {})
    if isinstance(loss, dict) and "moe_loss_coeff" not in loss:
        loss["moe_loss_coeff"] = 1.0
        t.mapped.append("loss.moe_loss_coeff not set: 1.0 (InternEvo's default)")


def _family_switches(t: Translation, model: dict[str, Any], model_type: str) -> None:
    """What the family's InternEvo class hard-codes: Qwen's sigmoid shared-expert gate, Qwen3's q/k norm."""
    if model_type in QWEN_MOE_TYPES and "shared_expert_gate" not in model:
        model["shared_expert_gate"] = "sigmoid"
        if model.get("num_shared_experts"):
            t.mapped.append(f"{model_type}: shared experts gated by sigmoid(Linear(H, 1)) (InternEvo's Qwen2MoE)")
    if model_type == "QWEN3MOE":
        model["qk_norm"] = True
        t.mapped.append("QWEN3MOE: RMSNorm on q and k per head (InternEvo's use_qk_norm=True)")


def _qwen_moe_type(t: Translation, model_type: str, moe_type: str) -> None:
    """GShard on a Qwen family: Qwen2-MoE trains (with a warning), Qwen3-MoE is refused (see the module doc)."""
    if model_type not in QWEN_MOE_TYPES or moe_type != "GShard":
        return
    if model_type == "QWEN3MOE":
        t.refused.append(
            "model.moe_type='GShard' with model_type='QWEN3MOE': InternEvo's Qwen3-MoE decoder asserts "
            "Dropless; set model.moe_type='Dropless'"
        )
        return
    t.warnings.append(
        "model.moe_type='GShard' with model_type='QWEN2MOE': trained as GShard (capacity, dropped choices, "
        "per-layer loss), as InternEvo's Qwen2-MoE did when 57B_qwen2_MoE.py shipped; its develop decoder "
        "asserts Dropless, and Hugging Face Qwen2-MoE checkpoints are dropless: set model.moe_type='Dropless'"
        " for that"
    )


def _qwen_global_aux_loss(t: Translation, model: dict[str, Any], model_type: str) -> None:
    """InternEvo's Qwen MoE models compute one load-balancing loss from all layers' logits: only
    aux_loss_by_layer=False runs there."""
    kwargs = model.setdefault("moe_layer_kwargs", {})
    by_layer = kwargs.get("aux_loss_by_layer", _ABSENT)
    if by_layer is _ABSENT:
        kwargs["aux_loss_by_layer"] = False
        t.mapped.append(f"{model_type}: one load-balancing loss over all layers (aux_loss_by_layer=False)")
    elif by_layer is not False:
        t.refused.append(
            f"model.moe_layer_kwargs.aux_loss_by_layer={by_layer!r}: InternEvo's {model_type} model computes one "
            "loss from all layers' router logits; set False"
        )


def attention_bias_defaults(model_type: Any, model: dict[str, Any]) -> dict[str, bool]:
    """The q, k, v and o biases an InternEvo MoE class builds when the config does not set them (InternLM v1's
    are set as the dense INTERNLM type's)."""
    if model_type not in MOE_MODEL_TYPES or model_type == "INTERNLM_MoE":
        return {}
    return {key: value for key, value in (("qkv_bias", True), ("o_bias", False)) if key not in model}


def apply_attention_bias_defaults(t: Translation, model: dict[str, Any], defaults: dict[str, bool]) -> None:
    """Set `attention_bias_defaults` after the given biases were mapped, in one log line."""
    if not defaults:
        return
    model.update(defaults)
    shown = ", ".join(f"model.{key}={value}" for key, value in defaults.items())
    t.mapped.append(f"not set: {shown} (the InternEvo MoE class's defaults)")


def _layer_kwargs(t: Translation, kwargs: dict[str, Any], moe_type: str) -> None:
    """InternEvo's `moe_layer_kwargs`: Dropless's capacity_factor=None is its default (nothing dropped); options of
    kernels and of paths not built are ignored when they change nothing, refused when they would."""
    if moe_type == "Dropless" and "capacity_factor" in kwargs:
        capacity = kwargs.pop("capacity_factor")
        if capacity is None:
            t.ignored.append("model.moe_layer_kwargs.capacity_factor=None (Dropless: every routed choice computed)")
        else:
            t.refused.append(
                f"model.moe_layer_kwargs.capacity_factor={capacity!r} with moe_type='Dropless': a Dropless capacity "
                "is not built here; set None (or moe_type='GShard' for capacity and dropping)"
            )
    if moe_type == "GShard" and kwargs.get("drop_tokens") is False and kwargs.get("use_fused_gating", True):
        t.warnings.append(
            "model.moe_layer_kwargs.drop_tokens=False: InternEvo's default fused gating ignores it and drops at "
            "capacity; here every choice is computed (as its non-fused gating does)"
        )
    eval_factor = _pop(kwargs, "eval_capacity_factor")
    if eval_factor is not _ABSENT:
        if eval_factor == kwargs.get("capacity_factor", 1.0):
            t.ignored.append(f"model.moe_layer_kwargs.eval_capacity_factor={eval_factor} (= capacity_factor)")
        else:
            t.refused.append(
                f"model.moe_layer_kwargs.eval_capacity_factor={eval_factor!r}: evaluation uses capacity_factor here; "
                "set it equal to capacity_factor"
            )
    for key, built in NO_EFFECT_KWARGS.items():
        value = _pop(kwargs, key)
        if value is _ABSENT:
            continue
        allowed = built is None or value == built or (isinstance(built, tuple) and value in built)
        if allowed:
            t.ignored.append(f"model.moe_layer_kwargs.{key}")
        else:
            t.refused.append(f"model.moe_layer_kwargs.{key}={value!r}: {NO_EFFECT_FIX[key]}")


def map_expert_parallel(t: Translation, parallel: dict[str, Any]) -> None:
    """`parallel.expert` and `parallel.expert_weight` as written (`expert=4` taken as `dict(size=4)`); their sizes
    are resolved and checked with the world size (config/resolve.py). The expert weight all-gather's scheduling
    knobs have no effect here."""
    for key in ("expert", "expert_weight"):
        section = parallel.get(key)
        if section is None:
            continue
        if isinstance(section, int) and not isinstance(section, bool):
            parallel[key] = section = dict(size=section)
        if not isinstance(section, dict):
            continue
        for knob in ("launch_allgather_before", "forward_overlap_per"):
            if key == "expert_weight" and section.pop(knob, _ABSENT) is not _ABSENT:
                t.ignored.append(f"parallel.expert_weight.{knob}")
        t.mapped.append(f"parallel.{key}={section!r}: read as written (docs/parallelism.md, Expert parallel)")
