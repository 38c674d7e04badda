"""Qwen3-Next (`qwen3_next`) on the native decoder: three Gated DeltaNet blocks (model/gated_deltanet.py) for every
gated full-attention block (per-head output gate, zero-centred q/k norms, partial RoPE), zero-centred RMSNorms, and
mixtures of experts with a sigmoid-gated shared expert (softmax router, top-k renormalised).

Built from a Hugging Face folder alone (`model.hf_path`) or its config (`model.hf_config`); docs/qwen3_next.md.
`tools.export --hf` writes the folder back. Tensor, sequence and pipeline parallel, LoRA, a balancing loss and MTP
are refused in one line (not built).
"""

from typing import Any

from internlm_offload.family import Capabilities, FamilySpec, register_family
from internlm_offload.model.families.gpt_oss import folder_config

MODEL_TYPE = "qwen3_next"
# transformers' Qwen3NextConfig defaults (Qwen3-Next-80B-A3B) for keys a config.json leaves out
DEFAULT_EXPERTS, DEFAULT_TOP_K, DEFAULT_BLOCKS = 512, 10, 48


def check_section(model: Any) -> None:
    """A Qwen3-Next folder or config."""
    if (model.hf_path is None) == (model.hf_config is None):
        raise ValueError("model.type='qwen3_next' needs exactly one of model.hf_path and model.hf_config")
    if model.hf_config is not None and model.hf_config.get("model_type") != MODEL_TYPE:
        raise ValueError(
            f"model.hf_config['model_type']={model.hf_config.get('model_type')!r}: model.type='qwen3_next' builds "
            f"{MODEL_TYPE!r}"
        )
    if model.attn_impl == "eager":
        raise ValueError("model.attn_impl='eager': qwen3_next attends natively; use 'auto', 'sdpa' or 'flash'")


def blocks(model: Any) -> int:
    """config.json's `num_hidden_layers`."""
    return int(folder_config(model).get("num_hidden_layers", DEFAULT_BLOCKS))


def routed_experts(model: Any) -> int:
    """config.json's `num_experts`."""
    return int(folder_config(model).get("num_experts", DEFAULT_EXPERTS))


def experts_per_token(model: Any) -> int:
    """config.json's `num_experts_per_tok`."""
    return int(folder_config(model).get("num_experts_per_tok", DEFAULT_TOP_K))


FAMILY = register_family(
    FamilySpec(
        name="qwen3_next",
        entry="internlm_offload.model.families.qwen3_next.build",
        summary="Qwen3-Next (Gated DeltaNet + gated attention, sigmoid-gated shared expert) from a Hugging Face folder",
        capabilities=Capabilities(init_per_param=True, folder_export=True),
        check_section=check_section,
        routed_experts=routed_experts,
        experts_per_token=experts_per_token,
        blocks=blocks,
    )
)
