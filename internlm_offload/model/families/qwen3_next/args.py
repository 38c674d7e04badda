"""Qwen3-Next's architecture off a transformers Qwen3NextConfig (config.json with transformers' defaults)."""

from dataclasses import dataclass
from typing import Any

from internlm_offload.model.balancing import folder_coefficient
from internlm_offload.model.families.qwen3_next import CAUSAL_LMS, MODEL_TYPE

LINEAR, FULL = "linear_attention", "full_attention"  # transformers' names of the layer types


@dataclass(frozen=True)
class Qwen3NextArgs:
    """One Qwen3-Next / Qwen3.5 text model (transformers' key names; `num_layers` is `num_hidden_layers`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    fused_projections: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba; Qwen3.5's are split
    # feed-forward
    intermediate_size: int  # the dense blocks'
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    sparse: tuple[bool, ...]
    # transformers' balancing-loss weight where the config trains with it (`output_router_logits`), else None
    router_aux_coef: float | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    initializer_range: float


def args_from_config(config: Any) -> Qwen3NextArgs:
    """The args of a transformers Qwen3NextConfig / Qwen3_5MoeTextConfig / Qwen3_5TextConfig; ValueError for what is
    not built (a layer type of neither kind, attention biases, rope scaling)."""
    if config.model_type not in CAUSAL_LMS:
        raise ValueError(f"model_type={config.model_type!r}: the qwen3_next family builds {', '.join(CAUSAL_LMS)}")
    types = tuple(config.layer_types)
    unknown = sorted(set(types) - {LINEAR, FULL})
    if unknown or len(types) != config.num_hidden_layers:
        raise ValueError(
            f"layer_types={list(types)}: one of {LINEAR!r} / {FULL!r} per layer ({config.num_hidden_layers} layers)"
        )
    if config.attention_bias:
        raise ValueError("attention_bias=True: Qwen3-Next's attention has no biases here (not built)")
    rope = dict(config.rope_parameters)
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.rope_type={rope.get('rope_type')!r}: only 'default' is built")
    rotary_dim = int(config.head_dim * rope.get("partial_rotary_factor", 1.0))
    # Qwen3.5-MoE: every block sparse, the top-k always renormalised; Qwen3.5: every block dense
    experts = getattr(config, "num_experts", 0)
    step, dense_only = getattr(config, "decoder_sparse_step", 1), set(getattr(config, "mlp_only_layers", ()))
    sparse = tuple(experts > 0 and (i + 1) % step == 0 and i not in dense_only for i in range(len(types)))
    return Qwen3NextArgs(
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        layer_types=types,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rotary_dim=rotary_dim,
        rope_theta=rope["rope_theta"],
        linear_num_key_heads=config.linear_num_key_heads,
        linear_num_value_heads=config.linear_num_value_heads,
        linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        fused_projections=config.model_type == MODEL_TYPE,
        intermediate_size=getattr(config, "intermediate_size", 0),
        moe_intermediate_size=getattr(config, "moe_intermediate_size", 0),
        shared_expert_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0),
        num_experts=experts,
        num_experts_per_tok=getattr(config, "num_experts_per_tok", 0),
        norm_topk_prob=getattr(config, "norm_topk_prob", True),
        sparse=sparse,
        router_aux_coef=folder_coefficient(config),
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
    )
