"""Qwen3-Next on the shared decoder: `GatedDeltaNet` mixers on its linear-attention layers, `Attention` with the
per-head output gate, zero-centred q/k norms and partial RoPE on its full-attention layers; `MoE` with a softmax
router and a sigmoid-gated shared expert (or a dense SwiGLU where the config says); every RMSNorm but the
DeltaNet's output norm zero-centred. Multi-token prediction (model/mtp.py, zero-centred norms) runs its layers
after the stack, each around one more block of the last block's kind with full attention (`mtp_block_kind`: the
folders' `mtp.layers.{k}.self_attn`), its own router where the model has experts. Its balancing loss
(`model.balancing_loss`, or transformers' own where config.json sets `output_router_logits`; model/balancing.py)
comes back as `moe_aux`, unweighted, in training."""

import torch
from torch import nn

from internlm_offload.model.attention import Attention
from internlm_offload.model.balancing import training_aux_losses
from internlm_offload.model.decoder import Decoder, DecoderLayer
from internlm_offload.model.families.qwen3_next.args import FULL, LINEAR, Qwen3NextArgs
from internlm_offload.model.families.qwen3_next.folder_layout import SourceLayout
from internlm_offload.model.gated_deltanet import GatedDeltaNet
from internlm_offload.model.hooks import PoolsRouterStats
from internlm_offload.model.mlp import FeedForward
from internlm_offload.model.moe import MoE
from internlm_offload.model.mtp import MtpSettings
from internlm_offload.model.tensor_plan import BlockPlan, Region, TensorPlan


def layer_type(args: Qwen3NextArgs, i: int) -> str:
    """Block i's mixer kind; a multi-token-prediction block (i >= num_layers) attends in full (the released folders'
    `mtp.layers.{k}.self_attn`, XTuner's and vLLM's MTP layer)."""
    return args.layer_types[i] if i < args.num_layers else FULL


def sparse(args: Qwen3NextArgs, i: int) -> bool:
    """Whether block i's feed-forward holds the experts; a multi-token-prediction block's is the last block's
    (sparse in the MoE models, dense in `qwen3_5_text`)."""
    return args.sparse[min(i, args.num_layers - 1)]


def build_mixer(args: Qwen3NextArgs, i: int, attn_impl: str) -> nn.Module:
    """Block i's mixer: Gated DeltaNet (Qwen3-Next's fused projections, Qwen3.5's split ones) or the gated full
    attention."""
    if layer_type(args, i) == LINEAR:
        return GatedDeltaNet(
            args.hidden_size,
            args.linear_num_key_heads,
            args.linear_num_value_heads,
            args.linear_key_head_dim,
            args.linear_value_head_dim,
            conv_kernel=args.linear_conv_kernel_dim,
            norm_eps=args.rms_norm_eps,
            fused=args.fused_projections,
            attn_impl=attn_impl,
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
    if not sparse(args, i):
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


def mixer_region(args: Qwen3NextArgs, i: int) -> Region:
    """Block i's mixer by role (model/tensor_plan.py). Gated DeltaNet: the fused in_proj_qkvz / in_proj_ba column
    parallel (their rows are grouped per key head, so an even split of the rows is one of whole key-head groups:
    each rank's key heads with their value heads), out_proj row parallel, the conv, A_log, dt_bias and the gated
    norm whole on every rank (each reads its groups' channels and heads); Qwen3.5's split in_proj_z / in_proj_b /
    in_proj_a column parallel (rows by value head) and its in_proj_qkv whole, each rank multiplying by its groups'
    rows of it. Gated attention: wq (each head's [query | gate] rows) column parallel by whole heads, wo row parallel,
    the per-head q/k norms whole with summed gradients."""
    if layer_type(args, i) != LINEAR:
        return Region("attention", column=("attention.wq",), row=("attention.wo",), extra_args=2, whole_parameters=True)
    if args.fused_projections:
        column = ("attention.in_proj_qkvz", "attention.in_proj_ba")
    else:  # Qwen3.5: in_proj_qkv's rows are [Q | K | V], not a run per group: whole, each rank reading its rows
        column = ("attention.in_proj_z", "attention.in_proj_b", "attention.in_proj_a")
    return Region("attention", column=column, row=("attention.out_proj",), extra_args=2, whole_parameters=True)


def block_plan(args: Qwen3NextArgs, i: int) -> BlockPlan:
    """Block i's roles: its mixer's (`mixer_region`), a dense SwiGLU column / row parallel or a sparse block whole
    (its experts what expert parallel shards). A DeltaNet block states its key heads as its heads: the tensor size
    must divide them."""
    if sparse(args, i):
        feed_forward = Region("feed_forward")
    else:
        feed_forward = Region("feed_forward", column=("feed_forward.w1", "feed_forward.w3"), row=("feed_forward.w2",))
    if layer_type(args, i) == LINEAR:
        kv, kv_heads, heads = (), args.linear_num_key_heads, args.linear_num_key_heads
    else:
        kv, kv_heads, heads = ("attention.wk", "attention.wv"), args.num_key_value_heads, args.num_attention_heads
    return BlockPlan(
        attention=mixer_region(args, i),
        kv=kv,
        kv_heads=kv_heads,
        feed_forward=feed_forward,
        sparse=sparse(args, i),
        norms=("attention_norm", "ffn_norm"),
        heads=heads,
    )


class Qwen3Next(Decoder, PoolsRouterStats):
    """A Qwen3-Next / Qwen3.5 text model from `Qwen3NextArgs`; `balancing_loss` names its balancing loss
    (model/balancing.py BALANCING_LOSSES; None: none, as transformers' forward without `output_router_logits`); with
    `mtp`, multi-token prediction after its stack."""

    def __init__(
        self,
        args: Qwen3NextArgs,
        attn_impl: str = "auto",
        balancing_loss: str | None = None,
        mtp: MtpSettings | None = None,
    ) -> None:
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
            mtp=mtp,
        )
        self.args = args
        self.num_experts = args.num_experts
        self.balancing_loss = balancing_loss
        self.source_layout = SourceLayout()  # the build sets the folder's (what an --hf export writes back)

    def tensor_plan(self) -> TensorPlan:
        """Where tensor, sequence, expert parallel and the pipeline find this model's modules (model/tensor_plan.py)."""
        args = self.args
        blocks = tuple(block_plan(args, i) for i in range(args.num_layers))
        sides = self.mtp_side_blocks(lambda i: block_plan(args, i))
        return TensorPlan(
            embedding="tok_embeddings", final_norm="norm", head="output", blocks=blocks, side_blocks=sides
        )

    def aux_losses(self, stats: list) -> dict[str, torch.Tensor]:
        """`moe_aux`: the balancing loss of a training forward's routers, unweighted; none without one (a validation
        forward's losses are not training's)."""
        args = self.args
        return training_aux_losses(
            self.balancing_loss, stats, args.num_experts, args.num_experts_per_tok, self.stats_pool, self.training
        )
