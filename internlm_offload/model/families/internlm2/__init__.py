"""The native decoder family: InternLM2, and the models that are options of its blocks (Llama, InternLM v1,
Qwen2 / Qwen3 dense, Qwen2-MoE, Qwen3-MoE, Mixtral): RMSNorm, RoPE, grouped-query attention, SwiGLU or a mixture
of experts. Its parameters carry this trainer's names, so every parallel mode, tier and weights format applies."""

from typing import Any

from internlm_offload.family import Capabilities, FamilySpec, register_family


def check_section(model: Any) -> None:
    """Attention through sdpa or flash-attn (eager is transformers')."""
    if model.attn_impl == "eager":
        raise ValueError("model.attn_impl='eager' is for model.type='hf_causal_lm'; internlm2 has sdpa and flash")


FAMILY = register_family(
    FamilySpec(
        name="internlm2",
        entry="internlm_offload.model.families.internlm2.build",
        summary="the native decoder (InternLM2, Llama, InternLM, Qwen2/3, Qwen-MoE, Mixtral)",
        capabilities=Capabilities(
            native_experts=True,
            tensor_parallel=True,
            pipeline=True,
            init_per_param=True,
            one_block_copy=True,
            native_names=True,
            foreign_weights=True,
            config_vocab=True,
        ),
        check_section=check_section,
    )
)
