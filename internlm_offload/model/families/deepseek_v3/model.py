"""The DeepSeek-V3 lineage on the shared decoder: MLA (or GLM-4.5's grouped-query attention with partial RoPE),
dense-first SwiGLU blocks, and sparse blocks of the bias-balanced sigmoid router with an un-gated shared expert.

Its balancing is the router bias (moved once a step by engine/router_bias.py, `model.router_bias_update_speed`); a
balancing loss beside it is an option (`model.balancing_loss`, model/balancing.py: XTuner's over the global batch or
the micro-batch, DeepSeek-V3's sequence-wise), off by default as transformers' forward returns none. Multi-token
prediction (model/mtp.py) adds layers after the stack, each around one more sparse block (`build_feed_forward(args,
L + k)`: a block past the stack is never dense-first) with its own router.
"""

import torch
from torch import nn

from internlm_offload.model.attention import Attention
from internlm_offload.model.balancing import training_aux_losses
from internlm_offload.model.decoder import Decoder, DecoderLayer
from internlm_offload.model.dsa import SparseLatentAttention
from internlm_offload.model.families.deepseek_v3.args import DeepseekV3Args
from internlm_offload.model.hooks import PoolsRouterStats
from internlm_offload.model.indexer import LightningIndexer
from internlm_offload.model.mla import MultiLatentAttention
from internlm_offload.model.mlp import FeedForward
from internlm_offload.model.moe import MoE
from internlm_offload.model.mtp import MtpSettings
from internlm_offload.model.rope import rope_from_parameters, softmax_mscale
from internlm_offload.model.tensor_plan import BlockPlan, Region, Replicated, TensorPlan


def build_attention(args: DeepseekV3Args, attn_impl: str, i: int) -> nn.Module:
    """Block i's attention: MLA where the config has a latent (with DeepSeek Sparse Attention where it has an
    indexer), else GLM-4.5's grouped-query attention (its o_proj never biased)."""
    if args.mla:
        mla = {
            "hidden_size": args.hidden_size,
            "n_heads": args.num_attention_heads,
            "q_lora_rank": args.q_lora_rank,
            "kv_lora_rank": args.kv_lora_rank,
            "qk_nope_head_dim": args.qk_nope_head_dim,
            "qk_rope_head_dim": args.qk_rope_head_dim,
            "v_head_dim": args.v_head_dim,
            "attn_impl": attn_impl,
            "bias": args.attention_bias,
            "rope_interleave": args.rope_interleave,
            "softmax_mscale": softmax_mscale(args.rope_parameters),
        }
        return build_sparse_attention(args, i, mla) if args.dsa else MultiLatentAttention(**mla)
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


def build_sparse_attention(args: DeepseekV3Args, i: int, mla: dict) -> SparseLatentAttention:
    """Block i's DSA: its own indexer where `indexer_types[i]` is full, else the last full block's top-k; a
    multi-token-prediction block (i >= num_layers) owns one, as XTuner builds GLM-5's."""
    source = args.indexer_sources[i] if i < args.num_layers else i
    indexer = None
    if source == i:
        indexer = LightningIndexer(
            hidden_size=args.hidden_size,
            q_lora_rank=args.q_lora_rank,
            n_heads=args.index_n_heads,
            head_dim=args.index_head_dim,
            rope_dim=args.qk_rope_head_dim,
            rope_interleave=args.indexer_rope_interleave,
            topk=args.index_topk,
        )
    return SparseLatentAttention(layer=i, source=source, indexer=indexer, topk=args.index_topk, **mla)


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


def attention_region(args: DeepseekV3Args) -> Region:
    """The attention's roles: MLA's query and kv up-projections column parallel by whole heads (their rows are
    head-major blocks, so an even split of the rows is one of heads), o_proj row parallel, the down-projections and
    their latent norms whole on every rank, the rope key's gradient summed over them (every head reads it); GLM-4.5's
    wq column parallel and wo row parallel (wk, wv: the block's kv), its per-head q/k norms whole with summed
    gradients."""
    if not args.mla:  # extra arguments: rope, documents
        return Region(
            "attention",
            column=("attention.wq",),
            row=("attention.wo",),
            extra_args=2,
            whole_parameters=args.use_qk_norm,
        )
    if args.q_lora_rank is None:
        column, replicated = ("attention.q_proj",), ()
    else:
        column = ("attention.q_b_proj",)
        replicated = (Replicated("attention.q_a_proj"), Replicated("attention.q_a_layernorm"))
    replicated += (
        Replicated("attention.kv_a_proj_with_mqa", read_whole=args.qk_rope_head_dim),
        Replicated("attention.kv_a_layernorm"),
    )
    return Region("attention", column=column, row=("attention.o_proj",), extra_args=2, replicated=replicated)


def block_plan(args: DeepseekV3Args, i: int) -> BlockPlan:
    """Block i's roles (model/tensor_plan.py): a dense-first block's SwiGLU column / row parallel, a sparse block
    whole (its experts what expert parallel shards); i >= num_layers: a multi-token-prediction block (sparse)."""
    sparse = i not in args.dense_layers
    if sparse:
        feed_forward = Region("feed_forward")
    else:
        feed_forward = Region("feed_forward", column=("feed_forward.w1", "feed_forward.w3"), row=("feed_forward.w2",))
    if args.mla:  # kv_b_proj expands every head's key and value from the latent
        kv, kv_heads = ("attention.kv_b_proj",), args.num_attention_heads
    else:
        kv, kv_heads = ("attention.wk", "attention.wv"), args.num_key_value_heads
    return BlockPlan(
        attention=attention_region(args),
        kv=kv,
        kv_heads=kv_heads,
        feed_forward=feed_forward,
        sparse=sparse,
        norms=("attention_norm", "ffn_norm"),
        heads=args.num_attention_heads,
    )


class DeepseekV3(Decoder, PoolsRouterStats):
    """A model of the lineage from `DeepseekV3Args`; with `mtp`, multi-token prediction after its stack;
    `balancing_loss` names its balancing loss (model/balancing.py BALANCING_LOSSES; None: none)."""

    def __init__(
        self,
        args: DeepseekV3Args,
        attn_impl: str = "auto",
        mtp: MtpSettings | None = None,
        balancing_loss: str | None = None,
    ) -> None:
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
                args.hidden_size, args.rms_norm_eps, build_attention(args, attn_impl, i), build_feed_forward(args, i)
            ),
            inv_freq_fn=inv_freq_fn,
            rope_attention_factor=attention_factor,
            mtp=mtp,
        )
        self.args = args
        self.needs_documents = args.dsa  # DSA hands its top-k between blocks through the forward's Documents
        self.num_experts = args.n_routed_experts
        self.balancing_loss = balancing_loss

    def tensor_plan(self) -> TensorPlan:
        """Where tensor parallel and expert parallel find this model's modules (model/tensor_plan.py)."""
        blocks = tuple(block_plan(self.args, i) for i in range(self.args.num_layers))
        sides = self.mtp_side_blocks(lambda i: block_plan(self.args, i))
        return TensorPlan(
            embedding="tok_embeddings", final_norm="norm", head="output", blocks=blocks, side_blocks=sides
        )

    def aux_losses(self, stats: list) -> dict[str, torch.Tensor]:
        """`moe_aux`: the balancing loss of a training forward's routers, unweighted; none without one (a validation
        forward's losses are not training's)."""
        args = self.args
        return training_aux_losses(
            self.balancing_loss, stats, args.n_routed_experts, args.num_experts_per_tok, self.stats_pool, self.training
        )
