"""GPT-OSS (`gpt_oss`: gpt-oss-20b, gpt-oss-120b) on the native decoder: grouped-query attention with q/k/v/o biases,
per-head attention sinks, 128-token sliding windows alternating with full attention (config.json's `layer_types`),
YaRN RoPE; every block a mixture of experts whose router has a bias (top-k on the raw logits, softmax over the k)
and whose experts have biases and GPT-OSS's clamped SwiGLU.

Built from a Hugging Face folder alone (`model.hf_path`; its MXFP4 experts dequantised on load) or its config
(`model.hf_config`); docs/gpt_oss.md. `tools.export --hf` writes the folder back in bf16 / fp32 (never MXFP4).
Tensor parallel (mtp / msp / fsp: the sinks split with their heads; isp: each rank's attention keeps its heads'
sinks), pipelines and LoRA on the attention's projections are built; a balancing loss: transformers' own where
config.json sets `output_router_logits` (weighted by its `router_aux_loss_coef`), or `model.balancing_loss`
(transformers' or XTuner's; model/balancing.py).
"""

import json
from pathlib import Path
from typing import Any

from internlm_offload.family import Capabilities, FamilySpec, register_family

MODEL_TYPE = "gpt_oss"
# transformers' GptOssConfig defaults (gpt-oss-120b) for keys a config.json leaves out
DEFAULT_EXPERTS, DEFAULT_TOP_K, DEFAULT_BLOCKS = 128, 4, 36
# LoRA's targets: the attention's projections, as transformers names them -> as the model does (the experts are
# stacked tensors, not linears: they stay frozen, as the router does)
MODULE_NAMES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo"}
# `model.balancing_loss` of its softmax router: transformers' loss, XTuner's over the global batch or the micro-batch
BALANCING_LOSSES = ("transformers", "global_batch", "micro_batch")


def folder_config(model: Any) -> dict[str, Any]:
    """`model.hf_config`, or the folder's config.json ({} where it cannot be read: the build reports the folder)."""
    if model.hf_config is not None:
        return model.hf_config
    try:
        return json.loads((Path(model.hf_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def check_section(model: Any) -> None:
    """A GPT-OSS folder or config; flash-attn (no sinks) and transformers' eager are not this family's."""
    if (model.hf_path is None) == (model.hf_config is None):
        raise ValueError("model.type='gpt_oss' needs exactly one of model.hf_path and model.hf_config")
    if model.hf_config is not None and model.hf_config.get("model_type") != MODEL_TYPE:
        raise ValueError(
            f"model.hf_config['model_type']={model.hf_config.get('model_type')!r}: model.type='gpt_oss' builds "
            f"{MODEL_TYPE!r}"
        )
    if model.attn_impl in ("eager", "flash"):
        raise ValueError(
            f"model.attn_impl={model.attn_impl!r}: gpt_oss attends with its sinks in torch (flash-attn has no sinks); "
            "use 'auto' or 'sdpa'"
        )


def blocks(model: Any) -> int:
    """config.json's `num_hidden_layers`."""
    return int(folder_config(model).get("num_hidden_layers", DEFAULT_BLOCKS))


def routed_experts(model: Any) -> int:
    """config.json's `num_local_experts`."""
    return int(folder_config(model).get("num_local_experts", DEFAULT_EXPERTS))


def experts_per_token(model: Any) -> int:
    """config.json's `num_experts_per_tok`."""
    return int(folder_config(model).get("num_experts_per_tok", DEFAULT_TOP_K))


FAMILY = register_family(
    FamilySpec(
        name="gpt_oss",
        entry="internlm_offload.model.families.gpt_oss.build",
        summary="GPT-OSS (sinks, sliding windows, biased router and clamped-SwiGLU experts) from a Hugging Face folder",
        capabilities=Capabilities(
            tensor_parallel=True, pipeline=True, init_per_param=True, folder_export=True, lora=True, balancing_loss=True
        ),
        module_names=MODULE_NAMES,
        check_section=check_section,
        routed_experts=routed_experts,
        experts_per_token=experts_per_token,
        blocks=blocks,
        balancing_losses=BALANCING_LOSSES,
    )
)
