"""GPT-OSS on the shared decoder: `Attention` with biases, sinks and (on sliding layers) a window; `MoE` with the
biased top-k-then-softmax router and biased clamped-SwiGLU experts; YaRN RoPE (model/rope.py). Its balancing loss
(`model.balancing_loss`, or transformers' own where config.json sets `output_router_logits`; model/balancing.py) comes
back as `moe_aux`, unweighted, in training: its statistics are the softmax over all experts of the biased logits (what
transformers' loss is fed: the router's logits) and the top-k chosen."""

import torch
from torch import nn

from internlm_offload.model.attention import Attention
from internlm_offload.model.balancing import training_aux_losses
from internlm_offload.model.decoder import Decoder, DecoderLayer
from internlm_offload.model.experts import ClampedSwiGLU
from internlm_offload.model.families.gpt_oss.args import GptOssArgs
from internlm_offload.model.hooks import PoolsRouterStats
from internlm_offload.model.moe import MoE
from internlm_offload.model.rope import rope_from_parameters
from internlm_offload.model.tensor_plan import BlockPlan, Region, TensorPlan


def build_attention(args: GptOssArgs, i: int, attn_impl: str) -> Attention:
    """Block i's attention: biases on q, k, v and o, one sink per query head, its layer type's window."""
    return Attention(
        args.hidden_size,
        args.num_attention_heads,
        args.num_key_value_heads,
        attn_impl,
        bias=args.attention_bias,
        head_dim=args.head_dim,
        sinks=True,
        window=args.window(i),
    )


def build_feed_forward(args: GptOssArgs) -> MoE:
    """Every block's experts: every choice computed, the router's bias and softmax over the top-k logits, the
    experts' biases and clamped SwiGLU."""
    return MoE(
        args.hidden_size,
        args.intermediate_size,
        args.num_local_experts,
        args.num_experts_per_tok,
        moe_type="Dropless",
        router_bias=True,
        softmax_over_topk=True,
        expert_bias=True,
        expert_activation=ClampedSwiGLU(args.swiglu_alpha, args.swiglu_limit),
    )


def build_block(args: GptOssArgs, i: int, attn_impl: str) -> nn.Module:
    """Block i: pre-norm attention of its layer type, then the experts."""
    return DecoderLayer(
        args.hidden_size, args.rms_norm_eps, build_attention(args, i, attn_impl), build_feed_forward(args)
    )


class GptOss(Decoder, PoolsRouterStats):
    """A GPT-OSS model from `GptOssArgs`; `balancing_loss` names its balancing loss (model/balancing.py
    BALANCING_LOSSES; None: none, as transformers' forward without `output_router_logits`)."""

    def __init__(self, args: GptOssArgs, attn_impl: str = "auto", balancing_loss: str | None = None) -> None:
        inv_freq_fn, attention_factor = rope_from_parameters(args.rope_parameters, args.max_position_embeddings)
        super().__init__(
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            norm_eps=args.rms_norm_eps,
            rope_dim=args.head_dim,
            rope_base=args.rope_parameters["rope_theta"],
            tie_word_embeddings=args.tie_word_embeddings,
            init_std=args.initializer_range,
            block=lambda i: build_block(args, i, attn_impl),
            inv_freq_fn=inv_freq_fn,
            rope_attention_factor=attention_factor,
        )
        self.args = args
        self.num_experts = args.num_local_experts
        self.balancing_loss = balancing_loss

    def tensor_plan(self) -> TensorPlan:
        """Its modules by parallel role (model/tensor_plan.py): q/k/v column parallel with their biases, o row
        parallel (its bias added once, after the reduce), the sinks split with their query heads; every block sparse
        (whole on each tensor rank, its experts what expert parallel shards)."""
        attention = Region("attention", column=("attention.wq",), row=("attention.wo",), extra_args=2)  # rope, docs
        block = BlockPlan(
            attention=attention,
            kv=("attention.wk", "attention.wv"),
            kv_heads=self.args.num_key_value_heads,
            feed_forward=Region("feed_forward"),
            sparse=True,
            norms=("attention_norm", "ffn_norm"),
            heads=self.args.num_attention_heads,
            head_params=("attention.sinks",),
        )
        return TensorPlan(
            embedding="tok_embeddings", final_norm="norm", head="output", blocks=(block,) * self.args.num_layers
        )

    def aux_losses(self, stats: list) -> dict[str, torch.Tensor]:
        """`moe_aux`: the balancing loss of a training forward's routers, unweighted; none without one (a validation
        forward's losses are not training's)."""
        args = self.args
        return training_aux_losses(
            self.balancing_loss, stats, args.num_local_experts, args.num_experts_per_tok, self.stats_pool, self.training
        )
