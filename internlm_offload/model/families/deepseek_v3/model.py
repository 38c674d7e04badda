"""The DeepSeek-V3 lineage on the shared decoder: MLA (or GLM-4.5's grouped-query attention with partial RoPE),
dense-first SwiGLU blocks, and sparse blocks of the bias-balanced sigmoid router with an un-gated shared expert.

Its balancing is the router bias (moved once a step by engine/router_bias.py, `model.router_bias_update_speed`), not a
loss: the forward returns no auxiliary loss, as transformers' does not.
"""

import torch
from torch import nn

from internlm_offload.model.attention import Attention
from internlm_offload.model.decoder import Decoder, DecoderLayer
from internlm_offload.model.families.deepseek_v3.args import DeepseekV3Args
from internlm_offload.model.mla import MultiLatentAttention
from internlm_offload.model.mlp import FeedForward
from internlm_offload.model.moe import MoE
from internlm_offload.model.rope import rope_from_parameters, softmax_mscale


def build_attention(args: DeepseekV3Args, attn_impl: str) -> nn.Module:
    """MLA where the config has a latent, else GLM-4.5's grouped-query attention (its o_proj never biased)."""
    if args.mla:
        return MultiLatentAttention(
            hidden_size=args.hidden_size,
            n_heads=args.num_attention_heads,
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=args.qk_rope_head_dim,
            v_head_dim=args.v_head_dim,
            attn_impl=attn_impl,
            bias=args.attention_bias,
            rope_interleave=args.rope_interleave,
            softmax_mscale=softmax_mscale(args.rope_parameters),
        )
    return Attention(
        args.hidden_size,
        args.num_attention_heads,
        args.num_key_value_heads,
        attn_impl,
        bias=args.attention_bias,
        head_dim=args.head_dim,
        qk_norm=args.use_qk_norm,
        norm_eps=args.rms_norm_eps,
        o_bias=False,
        rotary_dim=args.rope_dim,
    )


def build_feed_forward(args: DeepseekV3Args, i: int) -> nn.Module:
    """Block i's SwiGLU of `intermediate_size` (a dense-first block), or its mixture of experts."""
    if i in args.dense_layers:
        return FeedForward(args.hidden_size, args.intermediate_size)
    return MoE(
        args.hidden_size,
        args.moe_intermediate_size,
        args.n_routed_experts,
        args.num_experts_per_tok,
        moe_type="Dropless",
        num_shared_experts=args.n_shared_experts,
        shared_expert_gate="none",
        normalize_expert_weights=args.norm_topk_prob,
        scoring_func="sigmoid",
        routed_scaling_factor=args.routed_scaling_factor,
        score_correction_bias=True,
        n_group=args.n_group,
        topk_group=args.topk_group,
    )


class DeepseekV3(Decoder):
    """A model of the lineage from `DeepseekV3Args`."""

    def __init__(self, args: DeepseekV3Args, attn_impl: str = "auto") -> None:
        inv_freq_fn, attention_factor = rope_from_parameters(args.rope_parameters, args.max_position_embeddings)
        super().__init__(
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            norm_eps=args.rms_norm_eps,
            rope_dim=args.rope_dim,
            rope_base=args.rope_parameters["rope_theta"],
            tie_word_embeddings=args.tie_word_embeddings,
            init_std=args.initializer_range,
            block=lambda i: DecoderLayer(
                args.hidden_size, args.rms_norm_eps, build_attention(args, attn_impl), build_feed_forward(args, i)
            ),
            inv_freq_fn=inv_freq_fn,
            rope_attention_factor=attention_factor,
        )
        self.args = args
        self.num_experts = args.n_routed_experts

    def aux_losses(self, stats: list) -> dict[str, torch.Tensor]:
        return {}
