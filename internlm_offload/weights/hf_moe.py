"""Hugging Face mixture-of-experts folders (Qwen3-MoE, Qwen2-MoE, Mixtral): config.json against the native model's
config, and the config.json of an export.

Each family is the native decoder with some options fixed: every routed choice computed (`moe_type="Dropless"`),
softmax scores, no routed scaling; Qwen3-MoE adds q/k norms and Qwen's dense blocks, Qwen2-MoE a sigmoid-gated
shared expert and biases on q, k, v, Mixtral renormalises the top-k always. `folder_values` reads those settings
off a config.json as `model.*` values, `model_values` reads the same off the native config, and a load compares
the two; an export picks the family whose fixed options the native model has (`family_of`).
"""

from typing import Any

from internlm_offload.config import ModelConfig, intermediate_size
from internlm_offload.errors import CheckpointError
from internlm_offload.model.families.internlm2.hf_names import HF_MIXTRAL, HF_QWEN2_MOE, HF_QWEN3_MOE

TABLES = {"qwen3_moe": HF_QWEN3_MOE, "qwen2_moe": HF_QWEN2_MOE, "mixtral": HF_MIXTRAL}
ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

# The setting each compared value stands for: `model.*` keys to set, and the config.json key it comes from.
_KEYS = {
    "num_layers": ("model.num_layers", "num_hidden_layers"),
    "hidden_size": ("model.hidden_size", "hidden_size"),
    "num_attention_heads": ("model.num_attention_heads", "num_attention_heads"),
    "num_kv_attention_heads": ("model.num_kv_attention_heads", "num_key_value_heads"),
    "vocab_size": ("model.vocab_size", "vocab_size"),
    "norm_eps": ("model.norm_eps", "rms_norm_eps"),
    "rope_base": ("model.rope_base", "rope_theta"),
    "tie_word_embeddings": ("model.tie_word_embeddings", "tie_word_embeddings"),
    "head_dim": ("model.head_dim", "head_dim"),
    "qk_norm": ("model.qk_norm", "model_type (q/k norms)"),
    "qkv_bias": ("model.qkv_bias", "q/k/v biases"),
    "o_bias": ("model.o_bias", "o_proj bias"),
    "num_experts": ("model.num_experts", "num_experts"),
    "top_k": ("model.top_k", "num_experts_per_tok"),
    "moe_type": ("model.moe_type", "routing (every choice computed)"),
    "expert_width": ("model.mlp_ratio and model.multiple_of", "expert width"),
    "num_shared_experts": ("model.num_shared_experts", "shared_expert_intermediate_size / expert width"),
    "shared_expert_gate": ("model.shared_expert_gate", "shared expert gate"),
    "normalize_expert_weights": ("model.moe_layer_kwargs.normalize_expert_weights", "norm_topk_prob"),
    "scoring_func": ("model.moe_layer_kwargs.scoring_func", "router scores"),
    "routed_scaling_factor": ("model.moe_layer_kwargs.routed_scaling_factor", "routed scaling"),
    "sparse_blocks": ("model.mlp_only_layers and model.decoder_sparse_step", "sparse blocks"),
    "dense_width": ("model.dense_intermediate_size", "intermediate_size (dense blocks)"),
}


def folder_values(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The native settings (keys of `_KEYS`) a Qwen3-MoE, Qwen2-MoE or Mixtral config.json (`where`) describes; any
    other family is refused in one line (its keys would read as no experts, another router: DeepSeek-V3's and
    GLM-4-MoE's `n_routed_experts` and bias-corrected router)."""
    family = hf.get("model_type")
    if family not in TABLES:
        raise CheckpointError(
            f"{where}: model_type={family!r}; the native mixture of experts is built from {', '.join(TABLES)} "
            "config.json files (other architectures train as model.type='hf_causal_lm' with model.hf_path)"
        )
    hidden, heads, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    expert_width = hf["intermediate_size"] if family == "mixtral" else hf["moe_intermediate_size"]
    biased = bool(hf.get("attention_bias", False))  # Qwen3-MoE's: on q, k, v and o
    qkv_bias = bool(hf.get("qkv_bias", True)) if family == "qwen2_moe" else family == "qwen3_moe" and biased
    values = {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_kv_attention_heads": hf.get("num_key_value_heads") or heads,
        "vocab_size": hf["vocab_size"],
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_base": float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "head_dim": hf.get("head_dim") or hidden // heads,
        "qk_norm": family == "qwen3_moe",
        "qkv_bias": qkv_bias,
        "o_bias": family == "qwen3_moe" and biased,
        "num_experts": hf.get("num_experts", hf.get("num_local_experts")),
        "top_k": hf["num_experts_per_tok"],
        "moe_type": "Dropless",
        "expert_width": expert_width,
        "num_shared_experts": 0,
        "normalize_expert_weights": family == "mixtral" or bool(hf.get("norm_topk_prob", False)),
        "scoring_func": "softmax",
        "routed_scaling_factor": 1.0,
        "sparse_blocks": list(range(layers)),
    }
    if family == "qwen2_moe":
        shared = hf["shared_expert_intermediate_size"]
        values["num_shared_experts"] = shared // expert_width if shared % expert_width == 0 else shared / expert_width
        values["shared_expert_gate"] = "sigmoid"
    if family != "mixtral":  # Qwen's rule: block i is sparse iff i not in mlp_only_layers and (i + 1) % step == 0
        dense, step = set(hf.get("mlp_only_layers") or ()), hf.get("decoder_sparse_step") or 1
        values["sparse_blocks"] = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
        if len(values["sparse_blocks"]) < layers:
            values["dense_width"] = hf["intermediate_size"]
    return values


def model_section(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The `model` section of a config that builds the native model of a MoE config.json (`where`; the values
    `check_config` wants); another family is refused (`folder_values`)."""
    values = folder_values(hf, where)
    hidden, width = values["hidden_size"], values["expert_width"]
    section = {key: values[key] for key in _KEYS if key in ModelConfig.model_fields and key in values}
    section.update(mlp_ratio=width / hidden, multiple_of=_rounding(hidden, width))
    section["moe_layer_kwargs"] = {
        "normalize_expert_weights": values["normalize_expert_weights"],
        "aux_loss_by_layer": False,  # transformers' loss: statistics pooled over all layers
    }
    dense = [i for i in range(values["num_layers"]) if i not in values["sparse_blocks"]]
    if dense:
        section.update(mlp_only_layers=dense, dense_intermediate_size=values["dense_width"])
    return section


def _rounding(hidden: int, width: int) -> int:
    """The largest `multiple_of` that gives `width` back from hidden * (width / hidden) (any width: itself)."""
    return next(m for m in (256, 128, 64, 32, 16, 8, 1, width) if intermediate_size(hidden, width / hidden, m) == width)


def model_values(model: ModelConfig, keys: list[str]) -> dict[str, Any]:
    """The same settings (`keys` of `_KEYS`) read off the native model's config."""
    expert_width = intermediate_size(model.hidden_size, model.mlp_ratio, model.multiple_of)
    kwargs = model.moe_layer_kwargs
    values = {key: getattr(model, key) for key in keys if key in type(model).model_fields}
    values.update(
        head_dim=model.head_dim or model.hidden_size // model.num_attention_heads,
        qkv_bias=model.attention_bias if model.qkv_bias is None else model.qkv_bias,
        o_bias=model.attention_bias if model.o_bias is None else model.o_bias,
        expert_width=expert_width,
        normalize_expert_weights=kwargs.normalize_expert_weights,
        scoring_func=kwargs.scoring_func,
        routed_scaling_factor=kwargs.routed_scaling_factor,
        sparse_blocks=[i for i in range(model.num_layers) if _sparse(model, i)],
        dense_width=model.dense_intermediate_size or expert_width,
    )
    return {key: values[key] for key in keys}


def _sparse(model: ModelConfig, i: int) -> bool:
    return model.num_experts > 0 and i not in model.mlp_only_layers and (i + 1) % model.decoder_sparse_step == 0


def check_config(where: str, hf: dict[str, Any], model: ModelConfig) -> None:
    """The folder's model must be the configured one: every difference, and what the native model does not build,
    in one line that names the keys to set."""
    problems = unsupported(hf)
    try:
        wanted = folder_values(hf, where)
    except KeyError as exc:
        raise CheckpointError(f"{where}: no {exc.args[0]!r}; a {hf['model_type']} config.json has it") from None
    ours = model_values(model, list(wanted))
    for key, found in wanted.items():
        if found != ours[key]:
            model_key, hf_key = _KEYS[key]
            problems.append(f"{hf_key}={found!r} (set {model_key} to match; it gives {ours[key]!r})")
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))


def unsupported(hf: dict[str, Any]) -> list[str]:
    """What the native model does not build of a MoE config.json: another activation, scaled RoPE, a sliding
    window, router noise, a shared expert that is not a whole number of experts wide."""
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (the native experts are SwiGLU: silu)")
    scaling = hf.get("rope_scaling") or {}
    rope_type = (hf.get("rope_parameters") or {}).get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        problems.append(f"RoPE scaling {rope_type!r} (the native model has plain RoPE)")
    sliding = [t for t in hf.get("layer_types") or () if t != "full_attention"]
    if hf.get("use_sliding_window") or sliding or (hf["model_type"] == "mixtral" and hf.get("sliding_window")):
        problems.append(f"sliding_window={hf.get('sliding_window')!r} (the native attention is full causal)")
    if hf.get("router_jitter_noise"):
        problems.append(f"router_jitter_noise={hf['router_jitter_noise']!r} (the native router adds no noise)")
    shared, width = hf.get("shared_expert_intermediate_size"), hf.get("moe_intermediate_size")
    if hf["model_type"] == "qwen2_moe" and shared and width and shared % width:
        problems.append(
            f"shared_expert_intermediate_size={shared} (the native shared expert is a whole number of experts of "
            f"moe_intermediate_size={width} wide)"
        )
    return problems


def family_of(model: ModelConfig) -> str:
    """The transformers architecture a native MoE model exports as: Qwen2-MoE with shared experts, Qwen3-MoE with
    q/k norms, Mixtral otherwise; an error names what no family holds."""
    values = model_values(model, list(_KEYS))
    shared = model.num_shared_experts > 0
    family = "qwen2_moe" if shared else "qwen3_moe" if model.qk_norm else "mixtral"
    problems = []
    if shared and model.shared_expert_gate != "sigmoid":
        problems.append(f"model.shared_expert_gate={model.shared_expert_gate!r} (Qwen2-MoE's gate is a sigmoid)")
    if values["scoring_func"] != "softmax":
        problems.append(f"model.moe_layer_kwargs.scoring_func={values['scoring_func']!r} (softmax in every family)")
    if values["routed_scaling_factor"] != 1.0:
        problems.append(f"model.moe_layer_kwargs.routed_scaling_factor={values['routed_scaling_factor']}")
    if family == "qwen2_moe" and (model.qk_norm or values["o_bias"]):
        problems.append(f"model.qk_norm={model.qk_norm} or model.o_bias={values['o_bias']} with shared experts")
    if family == "qwen3_moe" and values["qkv_bias"] != values["o_bias"]:
        problems.append(f"model.qkv_bias={values['qkv_bias']} with model.o_bias={values['o_bias']} (Qwen3-MoE: both)")
    if family == "mixtral":
        if values["qkv_bias"] or values["o_bias"]:
            problems.append("attention biases (Mixtral has none)")
        dense = sorted(set(range(model.num_layers)) - set(values["sparse_blocks"]))
        if dense:
            problems.append(f"dense blocks {dense} (Mixtral's are all sparse)")
        if model.moe_type == "Dropless" and not values["normalize_expert_weights"]:
            problems.append("normalize_expert_weights=False (Mixtral always renormalises)")
    if problems:
        raise CheckpointError(
            f"model.num_experts={model.num_experts}: no transformers MoE architecture (Qwen3-MoE, Qwen2-MoE, "
            f"Mixtral) holds {'; '.join(problems)}; export to safetensors instead"
        )
    return family


def export_config(model: ModelConfig, family: str, max_positions: int) -> dict[str, Any]:
    """The config.json keys of a native MoE model exported as `family` (transformers' own config class fills the
    rest)."""
    values = model_values(model, list(_KEYS))
    config = {
        "architectures": [ARCHITECTURES[family]],
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_kv_attention_heads,
        "head_dim": values["head_dim"],
        "vocab_size": model.vocab_size,
        "rms_norm_eps": model.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_base},
        "tie_word_embeddings": model.tie_word_embeddings,
        "max_position_embeddings": max_positions,
        "hidden_act": "silu",
        "num_experts_per_tok": model.top_k,
    }
    if family == "mixtral":
        return {**config, "num_local_experts": model.num_experts, "intermediate_size": values["expert_width"]}
    dense = sorted(set(range(model.num_layers)) - set(values["sparse_blocks"]))
    config.update(
        num_experts=model.num_experts,
        moe_intermediate_size=values["expert_width"],
        intermediate_size=values["dense_width"],
        norm_topk_prob=values["normalize_expert_weights"],
        mlp_only_layers=dense,
        decoder_sparse_step=1,  # the dense blocks all listed in mlp_only_layers
        use_sliding_window=False,
    )
    if family == "qwen3_moe":
        return {**config, "attention_bias": values["qkv_bias"]}
    return {
        **config,
        "qkv_bias": values["qkv_bias"],
        "shared_expert_intermediate_size": values["expert_width"] * model.num_shared_experts,
    }
