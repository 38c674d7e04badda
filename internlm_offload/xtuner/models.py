"""XTuner v1's model config classes of the Qwen3 families as the native model's `model` (and `loss`) sections.

An XTuner config names its architecture by class (`Qwen3Dense4BConfig()`, `Qwen3MoE30BA3Config()`), with
keyword overrides and attribute writes (the stand-ins record both), or by `get_model_config_from_hf(folder)`,
which reads a folder's config.json. The class defaults below are XTuner's (xtuner/v1/model/dense/qwen3.py and
moe/qwen3.py, InternLM/xtuner main, 2026): facts about those classes, in XTuner's field names. XTuner's Qwen3
attention is full causal (`use_sliding_window=False` in all of them; `sliding_window` is then unused), with q/k
RMSNorm and `head_dim` apart from hidden / heads. Its Qwen3-MoE router is softmax top-k, renormalised, with
every routed choice computed, and its balancing loss (`BalancingLossConfig`, alpha 0.001) is
alpha * sum over sparse blocks of E / (T k) * sum_e count_e * mean_t score_{t,e}: the native per-layer Dropless
loss (`aux_loss_by_layer=True`) times `loss.moe_loss_coeff`.
"""

from pathlib import Path
from typing import Any

from internlm_offload.model.families.internlm2.hf_config import model_section, unsupported
from internlm_offload.model.families.internlm2.hf_rules import first_dense, head_dim, kv_heads, mlp_width, rope_base
from internlm_offload.weights.hf_folder import read_config
from internlm_offload.xtuner.standins import Recorded, field, kind

_QWEN3 = {"vocab_size": 151936, "rms_norm_eps": 1e-6, "hidden_act": "silu", "use_sliding_window": False}
DENSE = {
    "Qwen3Dense0P6BConfig": {
        **_QWEN3,
        "num_hidden_layers": 28,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "rope_theta": 1e6,
        "heads": (16, 8, 128),
        "tie_word_embeddings": False,
    },
    "Qwen3Dense4BConfig": {
        **_QWEN3,
        "num_hidden_layers": 36,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "rope_theta": 5e6,
        "heads": (32, 8, 128),
        "tie_word_embeddings": True,
    },
    "Qwen3Dense8BConfig": {
        **_QWEN3,
        "num_hidden_layers": 36,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "rope_theta": 1e6,
        "heads": (32, 8, 128),
        "tie_word_embeddings": False,
    },
}
DENSE["Qwen3_8BConfig"] = DENSE["Qwen3Dense8BConfig"]  # its name in older XTuner v1 releases
_MOE = {
    "n_shared_experts": 0,
    "first_k_dense_replace": 0,
    "norm_topk_prob": True,
    "scoring_func": "softmax",
    "router_scaling_factor": 1.0,
    "balancing_loss_alpha": 0.001,
}
MOE = {
    "Qwen3MoE30BA3Config": {
        **_QWEN3,
        **_MOE,
        "num_hidden_layers": 48,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "rope_theta": 1e6,
        "heads": (32, 4, 128),
        "tie_word_embeddings": False,
        "n_routed_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
    },
    "Qwen3MoE235BA22Config": {
        **_QWEN3,
        **_MOE,
        "num_hidden_layers": 94,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "rope_theta": 1e6,
        "heads": (64, 4, 128),
        "tie_word_embeddings": False,
        "n_routed_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1536,
    },
}
FROM_HF = "get_model_config_from_hf"
KNOWN = (*DENSE, *MOE, FROM_HF)


class ModelClassError(ValueError):
    """A model config the native model cannot take: the message is the whole report line."""


def model_from_xtuner(model_cfg: Any) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The `model` and `loss` sections of an XTuner model config, and what was carried (report lines)."""
    name = kind(model_cfg)
    if name == FROM_HF:
        return _from_folder(model_cfg)
    if name not in DENSE and name not in MOE:
        raise ModelClassError(
            f"model_cfg={name}: not an XTuner model config mapped here (mapped: {', '.join(KNOWN)}); "
            "or give load_from, a Hugging Face folder"
        )
    values = _values(model_cfg, {**DENSE.get(name, {}), **MOE.get(name, {})})
    model, loss = _section(values, name in MOE)
    return model, loss, [f"model_cfg={name}(...) -> the native model ({_summary(model)}), initialised at random"]


def _values(model_cfg: Any, defaults: dict[str, Any]) -> dict[str, Any]:
    """The class defaults with the file's keywords and attribute writes on top (attention and router nested)."""
    values = {key: field(model_cfg, key, default) for key, default in defaults.items() if key != "heads"}
    attention = field(model_cfg, "attention")
    heads, kv_heads, head_dim = defaults["heads"]
    values["num_attention_heads"] = field(attention, "num_attention_heads", heads) if attention else heads
    values["num_key_value_heads"] = field(attention, "num_key_value_heads", kv_heads) if attention else kv_heads
    values["head_dim"] = field(attention, "head_dim", head_dim) if attention else head_dim
    values["qk_norm"] = field(attention, "qk_norm", True) if attention else True
    rope = field(model_cfg, "rope_parameters_cfg")
    if rope is not None:
        values["rope_theta"] = field(rope, "rope_theta", values["rope_theta"])
    router = field(model_cfg, "router")
    for key in ("norm_topk_prob", "scoring_func", "router_scaling_factor"):
        if router is not None and key in values:
            values[key] = field(router, key, values[key])
    balancing = field(model_cfg, "balancing_loss_cfg", _UNSET)
    if "balancing_loss_alpha" in values and balancing is not _UNSET:
        values["balancing_loss_alpha"] = 0.0 if balancing is None else field(balancing, "balancing_loss_alpha", 0.001)
    for key in ("z_loss_cfg", "mtp_config", "float8_cfg"):
        if field(model_cfg, key) is not None:
            raise ModelClassError(f"model_cfg.{key}={field(model_cfg, key)!r}: not built here")
    return values


_UNSET = object()


def _section(values: dict[str, Any], sparse: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """XTuner's Qwen3 fields as the native `model` section (and `loss` for the balancing loss)."""
    if values["hidden_act"] != "silu" or values["use_sliding_window"]:
        raise ModelClassError(
            f"hidden_act={values['hidden_act']!r}, use_sliding_window={values['use_sliding_window']!r}: the native "
            "model is SwiGLU (silu) with full causal attention"
        )
    hidden = values["hidden_size"]
    model: dict[str, Any] = {
        "type": "internlm2",
        "num_layers": values["num_hidden_layers"],
        "hidden_size": hidden,
        "num_attention_heads": values["num_attention_heads"],
        "num_kv_attention_heads": values["num_key_value_heads"],
        "head_dim": values["head_dim"],
        "qk_norm": bool(values["qk_norm"]),
        "vocab_size": values["vocab_size"],
        "norm_eps": values["rms_norm_eps"],
        "rope_base": float(values["rope_theta"]),
        "tie_word_embeddings": bool(values["tie_word_embeddings"]),
        **mlp_width(hidden, values["moe_intermediate_size"] if sparse else values["intermediate_size"]),
    }
    if not sparse:
        return model, {}
    if values["n_shared_experts"]:
        raise ModelClassError(f"n_shared_experts={values['n_shared_experts']}: XTuner's Qwen3-MoE has none")
    model.update(
        num_experts=values["n_routed_experts"],
        top_k=values["num_experts_per_tok"],
        moe_type="Dropless",
        moe_layer_kwargs={
            "normalize_expert_weights": bool(values["norm_topk_prob"]),
            "scoring_func": values["scoring_func"],
            "routed_scaling_factor": float(values["router_scaling_factor"]),
            "aux_loss_by_layer": True,  # XTuner's balancing loss: per block, summed
        },
    )
    if values["first_k_dense_replace"]:
        model.update(
            mlp_only_layers=first_dense(values["first_k_dense_replace"]),
            dense_intermediate_size=values["intermediate_size"],
        )
    return model, {"moe_loss_coeff": float(values["balancing_loss_alpha"])}


def _from_folder(model_cfg: Recorded) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """`get_model_config_from_hf(folder)`: the architecture of a local Qwen3 or Qwen3-MoE folder's config.json."""
    folder = Path(str(model_cfg.args[0] if model_cfg.args else model_cfg.kwargs.get("model_path")))
    hf = read_config(folder)  # CheckpointError names a missing folder or config.json
    family = hf.get("model_type")
    if family == "qwen3_moe":
        problems = unsupported(hf)
        if problems:
            raise ModelClassError(f"{folder}: {'; '.join(problems)}")
        model = {"type": "internlm2", **model_section(hf)}
        model["moe_layer_kwargs"]["aux_loss_by_layer"] = True  # XTuner's balancing loss, as for its classes
        loss = {"moe_loss_coeff": 0.001}  # BalancingLossConfig's alpha, which from_hf leaves at its default
    elif family == "qwen3":
        values = {
            **_QWEN3,
            "tie_word_embeddings": False,
            **{k: v for k, v in hf.items() if k in DENSE["Qwen3Dense8BConfig"]},
        }
        values.update(
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=kv_heads(hf),
            head_dim=head_dim(hf["hidden_size"], hf["num_attention_heads"], hf.get("head_dim")),
            qk_norm=True,
            rope_theta=rope_base(hf),
        )
        model, loss = _section(values, sparse=False)
    else:
        raise ModelClassError(
            f"{FROM_HF}({str(folder)!r}): model_type={family!r}; mapped onto the native model here: qwen3, qwen3_moe"
        )
    return model, loss, [f"model_cfg={FROM_HF}({str(folder)!r}) -> the native model ({_summary(model)})"]


def _summary(model: dict[str, Any]) -> str:
    text = f"{model['num_layers']} blocks, hidden {model['hidden_size']}, head_dim {model.get('head_dim')}"
    return text + (f", {model['num_experts']} experts top-{model['top_k']}" if model.get("num_experts") else "")
