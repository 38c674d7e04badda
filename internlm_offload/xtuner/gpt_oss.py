"""XTuner v1's GPT-OSS configs as the native family, `model.type='gpt_oss'` (model/families/gpt_oss).

Mapped: `GptOss21BA3P6Config(...)` (gpt-oss-20b) and `GptOss117BA5P8Config(...)` (gpt-oss-120b), with their keyword
overrides and attribute writes; `GptOssConfig(...)` with `load_from`; and `get_model_config_from_hf(folder)` of a
`gpt_oss` folder. With `load_from` the model is that folder (`model.hf_path`: its architecture and weights, the
class's values giving way to config.json, as for every folder here); without it, the class's architecture as
config.json's keys (`model.hf_config`) initialised at random, as XTuner initialises a model config without weights.

The classes' fields (xtuner/v1/model/moe/gpt_oss.py, InternLM/xtuner main, 2026) in transformers' names:
`n_routed_experts` -> `num_local_experts`, `moe_intermediate_size` -> `intermediate_size` (each expert's width, what
XTuner builds), `attention.{num_attention_heads, num_key_value_heads, head_dim, sliding_window}` as they are,
`rope_parameters_cfg` -> `rope_parameters`, `moe_act_fn_cfg.{clip_alpha, clip_limit}` -> `swiglu_{alpha, limit}`.
XTuner's layer types are transformers' default (even blocks slide) and its greedy router (softmax over all, top-k,
renormalised) picks and weighs as transformers' top-k-then-softmax does. What the family does not build is fatal, one
line each: no sinks, q/k/v biases apart from o's, experts or router without biases, another activation or router.
XTuner's balancing loss (on by default in every `MoEConfig`) carries as for the DeepSeek lineage:
`balancing_loss_global_average` True / False -> `model.balancing_loss` 'global_batch' / 'micro_batch',
`balancing_loss_alpha` -> `loss.moe_loss_coeff` (its router weights: the softmax over all experts of the biased logits,
model/balancing.py). A z-loss and XTuner's GPU-only kernels are reported.
"""

from pathlib import Path
from typing import Any

from internlm_offload.errors import CheckpointError
from internlm_offload.model.families.gpt_oss import MODEL_TYPE
from internlm_offload.weights.hf_folder import read_config
from internlm_offload.xtuner.deepseek import FamilyModel, carry_balancing, gpu_only_kernels
from internlm_offload.xtuner.models import FROM_HF, ModelClassError
from internlm_offload.xtuner.standins import field, kind

BASE = "GptOssConfig"
# the class defaults XTuner's named configs set (gpt_oss.py), in XTuner's field names; the attention's as a dict
_COMMON = {"vocab_size": 201088, "max_position_embeddings": 131072, "pad_token_id": 199999, "eos_token_id": 200002,
           "hidden_size": 2880, "moe_intermediate_size": 2880, "rms_norm_eps": 1e-5, "num_experts_per_tok": 4,
           "tie_word_embeddings": False}  # fmt: skip
CLASSES = {
    "GptOss21BA3P6Config": {**_COMMON, "num_hidden_layers": 24, "n_routed_experts": 32},
    "GptOss117BA5P8Config": {**_COMMON, "num_hidden_layers": 36, "n_routed_experts": 128},
}
ATTENTION = {"num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128}
# GptOssConfig's rope_parameters_cfg
ROPE = {"rope_theta": 150000.0, "rope_type": "yarn", "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
        "original_max_position_embeddings": 4096, "truncate": False}  # fmt: skip
CLIP_ALPHA, CLIP_LIMIT = 1.702, 7.0  # GptOssConfig's moe_act_fn_cfg
# XTuner field -> config.json key, where the names differ
RENAMED = {"n_routed_experts": "num_local_experts", "moe_intermediate_size": "intermediate_size"}
_UNSET = object()


def names_gpt_oss(model_cfg: Any, load_from: Any) -> bool:
    """Whether XTuner's model config is GPT-OSS: a named class, `GptOssConfig` with `load_from`, or
    `get_model_config_from_hf` of a `gpt_oss` folder (a folder not readable is not)."""
    name = kind(model_cfg)
    if name in CLASSES:
        return True
    if name == BASE:
        return load_from is not None
    return name == FROM_HF and _folder_type(model_cfg) == MODEL_TYPE


def gpt_oss_model(model_cfg: Any, load_from: Any) -> FamilyModel:
    """The `model` section of an XTuner config that `names_gpt_oss`; ModelClassError (or CheckpointError for an
    unreadable folder): the one report line."""
    name = kind(model_cfg)
    if load_from is not None:
        hf = read_config(Path(str(load_from)))
        if hf.get("model_type") != MODEL_TYPE:
            raise ModelClassError(
                f"load_from={str(load_from)!r}: model_type={hf.get('model_type')!r}; model_cfg={name} maps onto "
                f"model.type='gpt_oss', which builds {MODEL_TYPE!r}"
            )
        out = FamilyModel({"type": "gpt_oss", "hf_path": str(load_from)})
        out.carried.append(
            f"model_cfg={name}, load_from -> model.type='gpt_oss', model.hf_path (the folder's architecture and weights)"
        )
    elif name == FROM_HF:
        folder = Path(str(model_cfg.args[0] if model_cfg.args else field(model_cfg, "model_path")))
        out = FamilyModel({"type": "gpt_oss", "hf_config": read_config(folder)})
        out.carried.append(
            f"model_cfg={FROM_HF}({str(folder)!r}) -> model.type='gpt_oss', model.hf_config, initialised at random"
        )
    else:
        hf_config = class_config(model_cfg)
        out = FamilyModel({"type": "gpt_oss", "hf_config": hf_config})
        out.carried.append(
            f"model_cfg={name}(...) -> model.type='gpt_oss', model.hf_config ({hf_config['num_hidden_layers']} blocks, "
            f"{hf_config['num_local_experts']} experts, top-{hf_config['num_experts_per_tok']}), initialised at random"
        )
    check_built(model_cfg)
    carry_balancing_loss(model_cfg, out)
    out.dropped.extend(not_computed(model_cfg))
    return out


def class_config(model_cfg: Any) -> dict[str, Any]:
    """config.json's keys of a named class with the file's overrides."""
    defaults = CLASSES[kind(model_cfg)]
    hf: dict[str, Any] = {"model_type": MODEL_TYPE}
    for key, default in defaults.items():
        hf[RENAMED.get(key, key)] = field(model_cfg, key, default)
    attention = field(model_cfg, "attention")
    for key, default in ATTENTION.items():
        hf[key] = default if attention is None else field(attention, key, default)
    rope = field(model_cfg, "rope_parameters_cfg")
    hf["rope_parameters"] = {
        key: default if rope is None else field(rope, key, default) for key, default in ROPE.items()
    }
    act = field(model_cfg, "moe_act_fn_cfg")
    hf["swiglu_alpha"] = CLIP_ALPHA if act is None else field(act, "clip_alpha", CLIP_ALPHA)
    hf["swiglu_limit"] = CLIP_LIMIT if act is None else field(act, "clip_limit", CLIP_LIMIT)
    hf["attention_bias"] = True
    return hf


def check_built(model_cfg: Any) -> None:
    """ModelClassError naming the first field whose value the family does not build."""
    attention = field(model_cfg, "attention")
    if attention is not None:
        if field(attention, "with_sink", True) is not True:
            raise ModelClassError("model_cfg.attention.with_sink=False: GPT-OSS attends with its sinks here")
        qkv, o = field(attention, "qkv_bias", True), field(attention, "o_bias", True)
        if qkv is not True or o is not True:
            raise ModelClassError(
                f"model_cfg.attention.qkv_bias={qkv!r}, o_bias={o!r}: GPT-OSS's q/k/v and o biases are built together"
            )
    for key in ("gate_bias", "moe_bias"):
        if field(model_cfg, key, True) is not True:
            raise ModelClassError(f"model_cfg.{key}=False: GPT-OSS's router and experts have biases here")
    act = field(model_cfg, "moe_act_fn_cfg")
    if act is not None and field(act, "act_type", "clipped_swiglu") != "clipped_swiglu":
        raise ModelClassError(
            f"model_cfg.moe_act_fn_cfg.act_type={field(act, 'act_type')!r}: GPT-OSS's experts run the clamped SwiGLU"
        )
    router = field(model_cfg, "router")
    if router is not None:
        wanted = {"scoring_func": "softmax", "norm_topk_prob": True, "router_scaling_factor": 1.0}
        for key, value in wanted.items():
            if field(router, key, value) != value:
                raise ModelClassError(
                    f"model_cfg.router.{key}={field(router, key)!r}: GPT-OSS's router is the top-k of its logits, "
                    f"softmaxed over the k ({key}={value!r})"
                )


def carry_balancing_loss(model_cfg: Any, out: FamilyModel) -> None:
    """XTuner's balancing loss (`BalancingLossConfig`, every `MoEConfig`'s default) onto `model.balancing_loss` /
    `loss.moe_loss_coeff` (XTuner's formula over the softmax of the biased router logits: model/balancing.py)."""
    balancing = field(model_cfg, "balancing_loss_cfg", _UNSET)
    if balancing is _UNSET:
        carry_balancing(out, {}, "model_cfg.balancing_loss_cfg (unset: XTuner's default on every MoE config)")
    elif balancing is not None:
        carry_balancing(out, balancing, "model_cfg.balancing_loss_cfg")


def not_computed(model_cfg: Any) -> list[str]:
    """What XTuner adds to the training that the family does not compute, one line each; then its GPU-only kernels."""
    lines = []
    if field(model_cfg, "z_loss_cfg") is not None:
        lines.append("model_cfg.z_loss_cfg: XTuner's router z-loss is not computed by model.type='gpt_oss'")
    return lines + gpu_only_kernels(model_cfg)


def _folder_type(model_cfg: Any) -> str | None:
    try:
        folder = model_cfg.args[0] if model_cfg.args else field(model_cfg, "model_path")
        return read_config(Path(str(folder))).get("model_type")
    except (CheckpointError, AttributeError, TypeError):  # no folder, no config.json, not a recorded call
        return None
