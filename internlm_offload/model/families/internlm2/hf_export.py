"""The config.json of a native model exported as a Hugging Face folder: Llama's for a dense model (InternLM2's
architecture, which transformers, vLLM and the rest load without remote code), else that of the transformers
mixture of experts whose fixed options it has (`family_of`); what no architecture holds is refused in one line."""

from typing import Any

from internlm_offload.config import ModelConfig
from internlm_offload.errors import CheckpointError
from internlm_offload.model.families.internlm2.hf_rules import (
    dense_blocks,
    model_biases,
    model_dense_width,
    model_expert_width,
    model_head_dim,
    model_sparse_blocks,
)

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def llama_values(model: ModelConfig) -> dict[str, Any]:
    """The config.json values (Llama's and InternLM2's keys) the native model `model` has."""
    return {
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_kv_attention_heads,
        "intermediate_size": model_expert_width(model),
        "vocab_size": model.vocab_size,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_base,
        "tie_word_embeddings": model.tie_word_embeddings,
        "attention_bias": model.attention_bias,
    }


def export_family(model: ModelConfig) -> str:
    """The config.json `model_type` a native model exports as: Llama without experts, else `family_of`'s."""
    return family_of(model) if model.num_experts else "llama"


def llama_config(model: ModelConfig, max_positions: int, where: str) -> dict[str, Any]:
    """`LlamaConfig`'s keys of a dense native model; one Llama's config cannot hold is refused (`where`: the folder)."""
    qkv_bias, o_bias = model_biases(model)
    if qkv_bias != o_bias or model.qk_norm or model.num_experts:
        # Llama's attention_bias is on q, k, v and o alike, and it has no q/k norms or experts: its folder would
        # load without those weights (transformers drops unexpected names with a warning)
        raise CheckpointError(
            f"{where}: a LlamaForCausalLM folder cannot hold model.qkv_bias={qkv_bias} with model.o_bias={o_bias}, "
            f"model.qk_norm={model.qk_norm} or model.num_experts={model.num_experts}; export to safetensors instead"
        )
    return {
        **llama_values(model),
        "head_dim": model_head_dim(model),
        "max_position_embeddings": max_positions,
        "hidden_act": "silu",
        "mlp_bias": False,
        "architectures": [ARCHITECTURES["llama"]],
    }


def family_of(model: ModelConfig) -> str:
    """The transformers architecture a native MoE model exports as: Qwen2-MoE with shared experts, Qwen3-MoE with
    q/k norms, Mixtral otherwise; an error names what no family holds."""
    qkv_bias, o_bias = model_biases(model)
    kwargs = model.moe_layer_kwargs
    shared = model.num_shared_experts > 0
    family = "qwen2_moe" if shared else "qwen3_moe" if model.qk_norm else "mixtral"
    problems = []
    if shared and model.shared_expert_gate != "sigmoid":
        problems.append(f"model.shared_expert_gate={model.shared_expert_gate!r} (Qwen2-MoE's gate is a sigmoid)")
    if kwargs.scoring_func != "softmax":
        problems.append(f"model.moe_layer_kwargs.scoring_func={kwargs.scoring_func!r} (softmax in every family)")
    if kwargs.routed_scaling_factor != 1.0:
        problems.append(f"model.moe_layer_kwargs.routed_scaling_factor={kwargs.routed_scaling_factor}")
    if family == "qwen2_moe" and (model.qk_norm or o_bias):
        problems.append(f"model.qk_norm={model.qk_norm} or model.o_bias={o_bias} with shared experts")
    if family == "qwen3_moe" and qkv_bias != o_bias:
        problems.append(f"model.qkv_bias={qkv_bias} with model.o_bias={o_bias} (Qwen3-MoE: both)")
    if family == "mixtral":
        if qkv_bias or o_bias:
            problems.append("attention biases (Mixtral has none)")
        dense = dense_blocks(model.num_layers, model_sparse_blocks(model))
        if dense:
            problems.append(f"dense blocks {dense} (Mixtral's are all sparse)")
        if model.moe_type == "Dropless" and not kwargs.normalize_expert_weights:
            problems.append("normalize_expert_weights=False (Mixtral always renormalises)")
    if problems:
        raise CheckpointError(
            f"model.num_experts={model.num_experts}: no transformers MoE architecture (Qwen3-MoE, Qwen2-MoE, "
            f"Mixtral) holds {'; '.join(problems)}; export to safetensors instead"
        )
    return family


def moe_config(model: ModelConfig, family: str, max_positions: int) -> dict[str, Any]:
    """The config.json keys of a native MoE model exported as `family` (transformers' own config class fills the
    rest)."""
    width = model_expert_width(model)
    qkv_bias, _ = model_biases(model)
    config = {
        "architectures": [ARCHITECTURES[family]],
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_kv_attention_heads,
        "head_dim": model_head_dim(model),
        "vocab_size": model.vocab_size,
        "rms_norm_eps": model.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_base},
        "tie_word_embeddings": model.tie_word_embeddings,
        "max_position_embeddings": max_positions,
        "hidden_act": "silu",
        "num_experts_per_tok": model.top_k,
    }
    if family == "mixtral":
        return {**config, "num_local_experts": model.num_experts, "intermediate_size": width}
    config.update(
        num_experts=model.num_experts,
        moe_intermediate_size=width,
        intermediate_size=model_dense_width(model),
        norm_topk_prob=model.moe_layer_kwargs.normalize_expert_weights,
        mlp_only_layers=dense_blocks(model.num_layers, model_sparse_blocks(model)),
        decoder_sparse_step=1,  # the dense blocks all listed in mlp_only_layers
        use_sliding_window=False,
    )
    if family == "qwen3_moe":
        return {**config, "attention_bias": qkv_bias}
    return {**config, "qkv_bias": qkv_bias, "shared_expert_intermediate_size": width * model.num_shared_experts}
