"""Qwen3-Next on the shared decoder: `GatedDeltaNet` mixers on its linear-attention layers, `Attention` with the
per-head output gate, zero-centred q/k norms and partial RoPE on its full-attention layers; `MoE` with a softmax
router and a sigmoid-gated shared expert (or a dense SwiGLU where the config says); every RMSNorm but the
DeltaNet's output norm zero-centred."""

from torch import nn

from internlm_offload.model.attention import Attention
from internlm_offload.model.decoder import Decoder, DecoderLayer
from internlm_offload.model.families.qwen3_next.args import LINEAR, Qwen3NextArgs
from internlm_offload.model.gated_deltanet import GatedDeltaNet
from internlm_offload.model.mlp import FeedForward
from internlm_offload.model.moe import MoE


def build_mixer(args: Qwen3NextArgs, i: int, attn_impl: str) -> nn.Module:
    """Block i's mixer: Gated DeltaNet (Qwen3-Next's fused projections, Qwen3.5's split ones) or the gated full
    attention."""
    if args.layer_types[i] == LINEAR:
        return GatedDeltaNet(
            args.hidden_size,
            args.linear_num_key_heads,
            args.linear_num_value_heads,
            args.linear_key_head_dim,
            args.linear_value_head_dim,
            conv_kernel=args.linear_conv_kernel_dim,
            norm_eps=args.rms_norm_eps,
            fused=args.fused_projections,
        )
    return Attention(
        args.hidden_size,
        args.num_attention_heads,
        args.num_key_value_heads,
        attn_impl,
        head_dim=args.head_dim,
        qk_norm=True,
        norm_eps=args.rms_norm_eps,
        rotary_dim=args.rotary_dim,
        output_gate=True,
        zero_centred_qk_norm=True,
    )


def build_feed_forward(args: Qwen3NextArgs, i: int) -> nn.Module:
    """Block i's feed-forward: the experts (softmax over all, top-k, renormalised if `norm_topk_prob`) with one
    shared expert scaled by sigmoid(Linear(x)), or a dense SwiGLU."""
    if not args.sparse[i]:
        return FeedForward(args.hidden_size, args.intermediate_size)
    return MoE(
        args.hidden_size,
        args.moe_intermediate_size,
        args.num_experts,
        args.num_experts_per_tok,
        moe_type="Dropless",
        num_shared_experts=1,
        shared_expert_gate="sigmoid",
        shared_intermediate_size=args.shared_expert_intermediate_size,
        normalize_expert_weights=args.norm_topk_prob,
    )


class Qwen3Next(Decoder):
    """A Qwen3-Next / Qwen3.5 text model from `Qwen3NextArgs` (no auxiliary loss: transformers' forward returns none by default)."""

    def __init__(self, args: Qwen3NextArgs, attn_impl: str = "auto") -> None:
        super().__init__(
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            norm_eps=args.rms_norm_eps,
            rope_dim=args.rotary_dim,
            rope_base=args.rope_theta,
            tie_word_embeddings=args.tie_word_embeddings,
            init_std=args.initializer_range,
            block=lambda i: DecoderLayer(
                args.hidden_size,
                args.rms_norm_eps,
                build_mixer(args, i, attn_impl),
                build_feed_forward(args, i),
                zero_centred_norms=True,
            ),
            zero_centred_norm=True,
        )
        self.args = args
        self.num_experts = args.num_experts
