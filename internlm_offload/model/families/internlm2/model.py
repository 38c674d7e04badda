"""InternLM2-style decoder-only LM: RMSNorm, RoPE, grouped-query attention, SwiGLU, no dropout; biases only on
the attention projections, and only when asked (InternLM v1, Llama's `attention_bias`, Qwen2's on q, k, v alone).

Qwen3's attention (an explicit `head_dim`, RMSNorm of q and k per head) and mixture-of-experts feed-forwards
(`num_experts > 0`, model/moe.py) are options of the same blocks: one family. The forward returns a `ModelOutput`
(model/output.py): an MoE model's load-balancing loss is in it as `moe_aux`, unweighted.
"""

import functools
from typing import Any

import torch
from torch import nn

from internlm_offload.model.attention import Attention
from internlm_offload.model.decoder import AuxLossFn, Decoder, DecoderLayer
from internlm_offload.model.families.internlm2.args import InternLM2Args
from internlm_offload.model.mlp import FeedForward
from internlm_offload.model.moe import MoE
from internlm_offload.model.output import MOE_AUX
from internlm_offload.model.router import RouterStats, dropless_aux_loss, global_aux_loss, gshard_aux_loss
from internlm_offload.model.tensor_plan import BlockPlan, Region, TensorPlan


def decoder_block_plan(kv_heads: int, sparse: bool, qk_norm: bool = False) -> BlockPlan:
    """A block's modules by tensor-parallel role (model/tensor_plan.py); with `qk_norm`, the per-head q/k norms whole
    on every rank, their gradients summed over the tensor group (each rank's heads give a part of it)."""
    if sparse:
        feed_forward = Region("feed_forward")
    else:
        feed_forward = Region("feed_forward", column=("feed_forward.w1", "feed_forward.w3"), row=("feed_forward.w2",))
    return BlockPlan(
        attention=Region(
            "attention", column=("attention.wq",), row=("attention.wo",), extra_args=2, whole_parameters=qk_norm
        ),  # extra: rope, documents
        kv=("attention.wk", "attention.wv"),
        kv_heads=kv_heads,
        feed_forward=feed_forward,
        sparse=sparse,
        norms=("attention_norm", "ffn_norm"),
    )


def build_block(args: InternLM2Args, i: int) -> DecoderLayer:
    """Block i: grouped-query attention, then a SwiGLU or (a sparse block) a mixture of experts."""
    qkv_bias, o_bias = args.projection_biases
    attention = Attention(
        args.hidden_size,
        args.num_attention_heads,
        args.num_kv_attention_heads,
        args.attn_impl,
        bias=qkv_bias,
        head_dim=args.attention_head_dim,
        qk_norm=args.qk_norm,
        norm_eps=args.norm_eps,
        o_bias=o_bias,
    )
    if i in args.sparse_layers:
        feed_forward: nn.Module = MoE(
            args.hidden_size,
            args.expert_width,
            args.num_experts,
            args.top_k,
            moe_type=args.moe_type,
            num_shared_experts=args.num_shared_experts,
            shared_expert_gate=args.shared_expert_gate,
            **args.moe_options,
        )
    else:
        feed_forward = FeedForward(args.hidden_size, args.dense_width)
    return DecoderLayer(args.hidden_size, args.norm_eps, attention, feed_forward)


class InternLM2(Decoder):
    """The native decoder of `InternLM2Args` (keyword arguments, checked and resolved once)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs["moe_layer_kwargs"] = dict(kwargs.get("moe_layer_kwargs") or {})
        kwargs["mlp_only_layers"] = tuple(kwargs.get("mlp_only_layers", ()))
        args = InternLM2Args(**kwargs)
        super().__init__(
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            norm_eps=args.norm_eps,
            rope_dim=args.attention_head_dim,
            rope_base=args.rope_base,
            tie_word_embeddings=args.tie_word_embeddings,
            init_std=args.init_std,
            block=lambda i: build_block(args, i),
        )
        self.args = args
        self.head_dim = args.attention_head_dim
        self.num_experts = args.num_experts
        # by the config, not by the blocks' classes: a block that should be sparse and is not is refused, not skipped
        self.sparse_layers = args.sparse_layers

    def tensor_plan(self) -> TensorPlan:
        """Where tensor parallel, isp and expert parallel find this decoder's modules (model/tensor_plan.py)."""
        kv_heads = self.args.num_kv_attention_heads
        blocks = tuple(
            decoder_block_plan(kv_heads, i in self.sparse_layers, self.args.qk_norm) for i in range(self.num_layers)
        )
        return TensorPlan(embedding="tok_embeddings", final_norm="norm", head="output", blocks=blocks)

    def aux_losses(self, stats: list[RouterStats]) -> dict[str, torch.Tensor]:
        """With experts, the load-balancing loss (`moe_aux`, without its coefficient)."""
        return {MOE_AUX: self.aux_loss(stats)} if self.num_experts else {}

    def aux_loss(self, stats: list[RouterStats]) -> torch.Tensor:
        """`moe_aux_loss` of the blocks' statistics; 0 when every block is dense (mlp_only_layers)."""
        if not stats:
            return torch.zeros((), device=self.output.weight.device)
        return moe_aux_loss(self.args, stats)

    def stage_aux_losses(self) -> AuxLossFn:
        """A pipeline stage's share: the per-layer loss of its own sparse blocks (the stages' add up to the whole
        model's); the global loss pools statistics over all blocks before its product and splits over no stages
        (config/pipeline.py refuses it)."""
        if not self.num_experts:
            return super().stage_aux_losses()
        if not self.args.aux_loss_by_layer:
            raise ValueError("aux_loss_by_layer=False: the global load-balancing loss does not split over stages")
        return functools.partial(stage_moe_aux_losses, self.args)


def moe_aux_loss(args: InternLM2Args, stats: list[RouterStats]) -> torch.Tensor:
    """InternEvo's per layer, summed over layers (1 per layer for a uniform router), or transformers' global one
    when `aux_loss_by_layer=False` (about top_k), of some sparse blocks' statistics (at least one)."""
    if not args.aux_loss_by_layer:
        return global_aux_loss(stats, args.num_experts)
    if args.moe_type == "GShard":
        return torch.stack([gshard_aux_loss(s, args.num_experts) for s in stats]).sum()
    return torch.stack([dropless_aux_loss(s, args.num_experts, args.top_k) for s in stats]).sum()


def stage_moe_aux_losses(args: InternLM2Args, stats: list[RouterStats]) -> dict[str, torch.Tensor]:
    """`moe_aux` of a pipeline stage's sparse blocks (`InternLM2.stage_aux_losses`); none for a stage without one."""
    return {MOE_AUX: moe_aux_loss(args, stats)} if stats else {}
