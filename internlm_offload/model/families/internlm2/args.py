"""The native decoder's arguments: the constructor's keywords, checked, with every derived value resolved once
(head_dim, the SwiGLU and expert widths, the biases, which blocks are sparse)."""

from dataclasses import dataclass, field
from typing import Any

from internlm_offload.model.attention import check_attn_impl
from internlm_offload.model.families.internlm2.hf_rules import (
    model_biases,
    model_dense_width,
    model_expert_width,
    model_head_dim,
    model_sparse_blocks,
)


@dataclass(frozen=True)
class InternLM2Args:
    """`InternLM2`'s keyword arguments. `qkv_bias`/`o_bias` (default: `attention_bias`) put biases on wq, wk, wv /
    wo apart. `num_experts > 0` makes the blocks sparse (model/moe.py), except those in `mlp_only_layers` or off the
    `decoder_sparse_step` (Qwen's rule: block i is sparse iff (i + 1) % step == 0), which get a dense SwiGLU of
    `dense_intermediate_size` (default: the expert width). `moe_layer_kwargs`: capacity_factor, min_capacity,
    drop_tokens (GShard); normalize_expert_weights, scoring_func, routed_scaling_factor (Dropless);
    aux_loss_by_layer (False: transformers' global loss over all layers)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_attention_heads: int
    vocab_size: int
    mlp_ratio: float = 8 / 3
    multiple_of: int = 64
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    tie_word_embeddings: bool = False
    init_std: float = 0.02
    attn_impl: str = "auto"
    attention_bias: bool = False
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    head_dim: int | None = None
    qk_norm: bool = False
    num_experts: int = 0
    top_k: int = 1
    moe_type: str = "GShard"
    num_shared_experts: int = 0
    shared_expert_gate: str = "softmax"
    moe_layer_kwargs: dict[str, Any] = field(default_factory=dict)
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    dense_intermediate_size: int | None = None

    def __post_init__(self) -> None:
        check_arguments(self)

    @property
    def attention_head_dim(self) -> int:
        """Each head's width (hf_rules.head_dim: `head_dim`, else hidden_size / num_attention_heads)."""
        return model_head_dim(self)

    @property
    def projection_biases(self) -> tuple[bool, bool]:
        """(on wq, wk, wv; on wo), each `attention_bias` unless given apart (hf_rules.model_biases)."""
        return model_biases(self)

    @property
    def expert_width(self) -> int:
        """The SwiGLU width of `mlp_ratio` (a dense model's, and each expert's)."""
        return model_expert_width(self)

    @property
    def dense_width(self) -> int:
        """The SwiGLU width of a dense block: `dense_intermediate_size` among experts, else the expert width."""
        return model_dense_width(self)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The sparse blocks (hf_rules.sparse_blocks, Qwen's rule): none without experts."""
        return tuple(model_sparse_blocks(self))

    @property
    def moe_options(self) -> dict[str, Any]:
        """`moe_layer_kwargs` for `MoE` (the loss's own `aux_loss_by_layer` taken out)."""
        return {key: value for key, value in self.moe_layer_kwargs.items() if key != "aux_loss_by_layer"}

    @property
    def aux_loss_by_layer(self) -> bool:
        """InternEvo's per-layer loss summed over layers (True), or transformers' global one."""
        return self.moe_layer_kwargs.get("aux_loss_by_layer", True)


def check_arguments(args: InternLM2Args) -> None:
    """Raise ValueError naming the first bad argument and its value."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_attention_heads", "vocab_size",
                 "multiple_of"):  # fmt: skip
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")
    for name in ("mlp_ratio", "norm_eps", "rope_base", "init_std"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive number")
    heads, kv_heads, hidden = args.num_attention_heads, args.num_kv_attention_heads, args.hidden_size
    if heads % kv_heads != 0:
        raise ValueError(f"num_attention_heads={heads} must be divisible by num_kv_attention_heads={kv_heads}")
    head_dim = args.head_dim
    if head_dim is not None:
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"head_dim={head_dim!r} must be a positive even int (RoPE rotates pairs)")
    elif hidden % heads != 0:
        raise ValueError(f"hidden_size={hidden} must be divisible by num_attention_heads={heads}")
    elif (hidden // heads) % 2 != 0:
        raise ValueError(f"hidden_size={hidden} / num_attention_heads={heads} is odd; RoPE needs an even head_dim")
    check_attn_impl(args.attn_impl)
