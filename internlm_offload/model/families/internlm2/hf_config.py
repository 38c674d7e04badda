"""A Hugging Face config.json of a format the native decoder loads (`hf_names.TABLES`) read as `model.*` values and
checked against a `model` section; what the decoder does not build is refused here, each in one line.

The dense formats (InternLM2, Llama, InternLM v1) are the native architecture. The mixture-of-experts ones (Qwen3-MoE,
Qwen2-MoE, Mixtral) are the native decoder with some options fixed: every routed choice computed
(`moe_type="Dropless"`), softmax scores, no routed scaling; Qwen3-MoE adds q/k norms and Qwen's dense blocks,
Qwen2-MoE a sigmoid-gated shared expert and biases on q, k, v, Mixtral renormalises the top-k always. `moe_values`
reads those settings off a config.json, `model_values` reads the same off the native config, and a load compares
the two. The rules each reading follows are `hf_rules`'.
"""

from typing import Any

from internlm_offload.config import ModelConfig
from internlm_offload.errors import CheckpointError
from internlm_offload.model.families.internlm2.hf_export import llama_values
from internlm_offload.model.families.internlm2.hf_names import DENSE_TABLES, MOE_TABLES, TABLES
from internlm_offload.model.families.internlm2.hf_rules import (
    dense_blocks,
    expert_width,
    folder_biases,
    folder_sparse_blocks,
    head_dim,
    hf_value,
    mlp_width,
    model_biases,
    model_dense_width,
    model_expert_width,
    model_head_dim,
    model_sparse_blocks,
    rope_scaling,
    shared_experts,
    whole_experts,
)
from internlm_offload.model.name_table import NameTable

# A dense config.json's key -> the model.* key(s) that set it here.
DENSE_KEYS = {
    "hidden_size": "model.hidden_size",
    "num_hidden_layers": "model.num_layers",
    "num_attention_heads": "model.num_attention_heads",
    "num_key_value_heads": "model.num_kv_attention_heads",
    "intermediate_size": "model.mlp_ratio and model.multiple_of",
    "vocab_size": "model.vocab_size",
    "rms_norm_eps": "model.norm_eps",
    "rope_theta": "model.rope_base",
    "tie_word_embeddings": "model.tie_word_embeddings",
    "attention_bias": "model.attention_bias",
}

# The setting each compared MoE value stands for: `model.*` keys to set, and the config.json key it comes from.
MOE_KEYS = {
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


def name_table(where: str, model_type: Any) -> NameTable:
    """The names of the format a config.json (`where`) names by `model_type`; another is refused."""
    if model_type not in TABLES:
        raise _not_built(where, model_type, "the native model loads", TABLES, "folders")
    return TABLES[model_type]


def _not_built(where: str, model_type: Any, subject: str, built: dict[str, Any], kind: str) -> CheckpointError:
    """The one refusal of a `model_type` the native decoder is not built from: what is, and where the rest trains."""
    return CheckpointError(
        f"{where}: model_type={model_type!r}; {subject} {', '.join(built)} {kind} "
        "(other architectures train as model.type='hf_causal_lm' with model.hf_path)"
    )


def unsupported(hf: dict[str, Any]) -> list[str]:
    """What the native decoder does not build of a config.json: another activation, scaled RoPE; of a dense one MLP
    biases and a head width apart from hidden / heads; of a mixture of experts a sliding window, router noise, a shared
    expert that is not a whole number of experts wide."""
    moe = hf.get("model_type") in MOE_TABLES
    problems = ["mlp_bias=True (the native model's MLP has no biases)"] if not moe and hf.get("mlp_bias") else []
    if hf.get("hidden_act", "silu") != "silu":
        mlp = "experts are" if moe else "model's MLP is"
        problems.append(f"hidden_act={hf['hidden_act']!r} (the native {mlp} SwiGLU: silu)")
    rope_type = rope_scaling(hf)
    if rope_type not in (None, "default"):
        problems.append(f"RoPE scaling {rope_type!r} (the native model has plain RoPE)")
    return problems + (_unsupported_moe(hf) if moe else _unsupported_dense(hf))


def _unsupported_dense(hf: dict[str, Any]) -> list[str]:
    heads, hidden, given = hf.get("num_attention_heads"), hf.get("hidden_size"), hf.get("head_dim")
    if given is not None and heads and hidden and given != head_dim(hidden, heads):
        return [f"head_dim={given} (the native model's is hidden_size / num_attention_heads)"]
    return []


def _unsupported_moe(hf: dict[str, Any]) -> list[str]:
    problems = []
    sliding = [t for t in hf.get("layer_types") or () if t != "full_attention"]
    if hf.get("use_sliding_window") or sliding or (hf["model_type"] == "mixtral" and hf.get("sliding_window")):
        problems.append(f"sliding_window={hf.get('sliding_window')!r} (the native attention is full causal)")
    if hf.get("router_jitter_noise"):
        problems.append(f"router_jitter_noise={hf['router_jitter_noise']!r} (the native router adds no noise)")
    shared, width = hf.get("shared_expert_intermediate_size"), hf.get("moe_intermediate_size")
    if hf["model_type"] == "qwen2_moe" and shared and width and not whole_experts(shared, width):
        problems.append(
            f"shared_expert_intermediate_size={shared} (the native shared expert is a whole number of experts of "
            f"moe_intermediate_size={width} wide)"
        )
    return problems


def native_model_values(hf: dict[str, Any]) -> dict[str, Any] | None:
    """The `model.*` settings of the dense native model a config.json describes; None when its architecture is not
    the native one (another model_type, MLP biases, scaled RoPE, ...)."""
    if hf.get("model_type") not in DENSE_TABLES or unsupported(hf):
        return None
    hidden, width = hf["hidden_size"], hf["intermediate_size"]
    return {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hidden,
        "num_attention_heads": hf["num_attention_heads"],
        "num_kv_attention_heads": hf_value(hf, "num_key_value_heads"),
        "vocab_size": hf["vocab_size"],
        **mlp_width(hidden, width),
        "norm_eps": hf_value(hf, "rms_norm_eps"),
        "rope_base": float(hf_value(hf, "rope_theta")),
        "tie_word_embeddings": bool(hf_value(hf, "tie_word_embeddings")),
        "attention_bias": bool(hf_value(hf, "attention_bias")),
    }


def moe_values(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The native settings (keys of `MOE_KEYS`) a Qwen3-MoE, Qwen2-MoE or Mixtral config.json (`where`) describes; any
    other family is refused in one line (its keys would read as no experts, another router: DeepSeek-V3's and
    GLM-4-MoE's `n_routed_experts` and bias-corrected router)."""
    family = hf.get("model_type")
    if family not in MOE_TABLES:
        raise _not_built(where, family, "the native mixture of experts is built from", MOE_TABLES, "config.json files")
    hidden, heads, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    width = expert_width(hf)
    qkv_bias, o_bias = folder_biases(hf)
    values = {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_kv_attention_heads": hf_value(hf, "num_key_value_heads"),
        "vocab_size": hf["vocab_size"],
        "norm_eps": hf_value(hf, "rms_norm_eps"),
        "rope_base": float(hf_value(hf, "rope_theta")),
        "tie_word_embeddings": bool(hf_value(hf, "tie_word_embeddings")),
        "head_dim": head_dim(hidden, heads, hf.get("head_dim")),
        "qk_norm": family == "qwen3_moe",
        "qkv_bias": qkv_bias,
        "o_bias": o_bias,
        "num_experts": hf.get("num_experts", hf.get("num_local_experts")),
        "top_k": hf["num_experts_per_tok"],
        "moe_type": "Dropless",
        "expert_width": width,
        "num_shared_experts": 0,
        "normalize_expert_weights": family == "mixtral" or bool(hf.get("norm_topk_prob", False)),
        "scoring_func": "softmax",
        "routed_scaling_factor": 1.0,
        "sparse_blocks": folder_sparse_blocks(hf),
    }
    if family == "qwen2_moe":
        values["num_shared_experts"] = shared_experts(hf["shared_expert_intermediate_size"], width)
        values["shared_expert_gate"] = "sigmoid"
    if len(values["sparse_blocks"]) < layers:
        values["dense_width"] = hf["intermediate_size"]
    return values


def model_section(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The `model` section of a config that builds the native model of a MoE config.json (`where`; the values
    `check_config` wants); another family is refused (`moe_values`)."""
    values = moe_values(hf, where)
    section = {key: values[key] for key in MOE_KEYS if key in ModelConfig.model_fields and key in values}
    section.update(mlp_width(values["hidden_size"], values["expert_width"]))
    section["moe_layer_kwargs"] = {
        "normalize_expert_weights": values["normalize_expert_weights"],
        "aux_loss_by_layer": False,  # transformers' loss: statistics pooled over all layers
    }
    dense = dense_blocks(values["num_layers"], values["sparse_blocks"])
    if dense:
        section.update(mlp_only_layers=dense, dense_intermediate_size=values["dense_width"])
    return section


def model_values(model: ModelConfig, keys: list[str]) -> dict[str, Any]:
    """The same settings (`keys` of `MOE_KEYS`) read off the native model's config."""
    kwargs = model.moe_layer_kwargs
    qkv_bias, o_bias = model_biases(model)
    values = {key: getattr(model, key) for key in keys if key in type(model).model_fields}
    values.update(
        head_dim=model_head_dim(model),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        expert_width=model_expert_width(model),
        normalize_expert_weights=kwargs.normalize_expert_weights,
        scoring_func=kwargs.scoring_func,
        routed_scaling_factor=kwargs.routed_scaling_factor,
        sparse_blocks=model_sparse_blocks(model),
        dense_width=model_dense_width(model),
    )
    return {key: values[key] for key in keys}


def check_config(where: str, hf: dict[str, Any], model: ModelConfig) -> None:
    """The config.json's (`where`) model must be the configured one: every difference, and what the native model does
    not build, in one line that names the keys to set."""
    moe = hf.get("model_type") in MOE_TABLES
    problems = _moe_differences(where, hf, model) if moe else _dense_differences(hf, model)
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))


def _dense_differences(hf: dict[str, Any], model: ModelConfig) -> list[str]:
    problems = (
        [f"model.num_experts={model.num_experts} (the folder's model is dense: set 0)"] if model.num_experts else []
    )
    problems += [
        f"{key}={found!r} (set {DENSE_KEYS[key]} to match; it gives {wanted!r})"
        for key, wanted in llama_values(model).items()
        if (found := hf_value(hf, key)) != wanted
    ]
    return problems + unsupported(hf)


def _moe_differences(where: str, hf: dict[str, Any], model: ModelConfig) -> list[str]:
    problems = unsupported(hf)
    try:
        wanted = moe_values(hf, where)
    except KeyError as exc:
        raise CheckpointError(f"{where}: no {exc.args[0]!r}; a {hf['model_type']} config.json has it") from None
    ours = model_values(model, list(wanted))
    for key, found in wanted.items():
        if found != ours[key]:
            model_key, hf_key = MOE_KEYS[key]
            problems.append(f"{hf_key}={found!r} (set {model_key} to match; it gives {ours[key]!r})")
    return problems
