"""The native decoder from the `model` section: its arguments, its auxiliary losses' weights, its LoRA targets."""

from typing import Any

import torch

from internlm_offload.config import ModelConfig, RunConfig
from internlm_offload.config.lora import native_targets
from internlm_offload.config.moe import moe_kwargs
from internlm_offload.model.families.internlm2.model import InternLM2
from internlm_offload.model.output import MOE_AUX


def model_arguments(cfg: ModelConfig) -> dict[str, Any]:
    """`InternLM2`'s keyword arguments from the model section (the MoE ones only with experts)."""
    kwargs: dict[str, Any] = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_kv_attention_heads=cfg.num_kv_attention_heads,
        vocab_size=cfg.vocab_size,
        mlp_ratio=cfg.mlp_ratio,
        multiple_of=cfg.multiple_of,
        norm_eps=cfg.norm_eps,
        rope_base=cfg.rope_base,
        tie_word_embeddings=cfg.tie_word_embeddings,
        init_std=cfg.init_std,
        attn_impl=cfg.attn_impl,
        attention_bias=cfg.attention_bias,
        qkv_bias=cfg.qkv_bias,
        o_bias=cfg.o_bias,
        head_dim=cfg.head_dim,
        qk_norm=cfg.qk_norm,
    )
    if cfg.num_experts:
        kwargs.update(
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            moe_type=cfg.moe_type,
            num_shared_experts=cfg.num_shared_experts,
            shared_expert_gate=cfg.shared_expert_gate,
            moe_layer_kwargs=moe_kwargs(cfg),
            mlp_only_layers=tuple(cfg.mlp_only_layers),
            decoder_sparse_step=cfg.decoder_sparse_step,
            dense_intermediate_size=cfg.dense_intermediate_size,
        )
    return kwargs


def build_model(cfg: ModelConfig, device: torch.device) -> InternLM2:
    """The decoder in fp32 on `device`, every weight drawn from the torch seed."""
    with torch.device(device):
        return InternLM2(**model_arguments(cfg))


def folder_format(model: InternLM2) -> None:
    """None: a folder loads through ckpt.load_ckpt_info (weights/sources.py)."""
    return None


def aux_loss_coefficients(cfg: RunConfig, model: InternLM2) -> dict[str, float]:
    """The router's load-balancing loss weighs `loss.moe_loss_coeff` (InternEvo's key); a dense model has none."""
    return {MOE_AUX: cfg.loss.moe_loss_coeff} if cfg.model.num_experts else {}


def lora_targets(cfg: ModelConfig) -> list[str]:
    """`model.lora.target_modules` as the decoder names its linears (Hugging Face names translated)."""
    assert cfg.lora is not None
    return native_targets(cfg.lora, cfg.type)
