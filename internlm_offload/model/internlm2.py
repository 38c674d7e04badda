"""InternLM2-style decoder-only LM: RMSNorm, RoPE, grouped-query attention, SwiGLU, no dropout; biases only on
the attention projections, and only when asked (InternLM v1, Llama's `attention_bias`, Qwen2's on q, k, v alone).

Qwen3's attention (an explicit `head_dim`, RMSNorm of q and k per head) and mixture-of-experts feed-forwards
(`num_experts > 0`, model/moe.py) are options of the same decoder. The forward returns a `ModelOutput`
(model/output.py): an MoE model's load-balancing loss is in it as `moe_aux`, unweighted.
"""

import contextlib
import functools
import math
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from internlm_offload.config import intermediate_size
from internlm_offload.model.hooks import ExchangesSequence, HasTensorPlan, ShardsSequence
from internlm_offload.model.mlp import FeedForward, ParamInit, normal_init
from internlm_offload.model.moe import MoE
from internlm_offload.model.output import MOE_AUX, ModelOutput
from internlm_offload.model.router import RouterStats, dropless_aux_loss, global_aux_loss, gshard_aux_loss
from internlm_offload.model.tensor_plan import BlockPlan, Region, TensorPlan
from internlm_offload.offload.activation import mark_not_offload

ATTN_IMPLS = ("sdpa", "flash", "auto")

# What `InternLM2.init_weights` does with each (parameter, init): by default `init(parameter)`.
ApplyInit = Callable[[nn.Parameter, ParamInit], None]


@functools.cache
def _flash_attn_func() -> Callable | None:
    """Return `flash_attn.flash_attn_func`, or None when flash-attn is not importable."""
    try:
        from flash_attn import flash_attn_func
    except Exception:  # a broken CUDA install raises more than ImportError
        return None
    return flash_attn_func


@functools.cache
def _flash_attn_varlen_func() -> Callable | None:
    """Return `flash_attn.flash_attn_varlen_func` (packed documents), or None."""
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:
        return None
    return flash_attn_varlen_func


class Documents:
    """Where the documents of packed rows begin, from `position_ids` (B, T) that restart at 0 per document.

    Each attention path derives what it needs once per forward: SDPA a mask, flash-attn varlen the
    document starts.
    """

    def __init__(self, position_ids: torch.Tensor) -> None:
        self.position_ids = position_ids

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """(B, 1, T, T), True where a token may attend: same document, not later."""
        mask = document_mask(self.position_ids)
        mark_not_offload(mask)  # every block saves the same mask: keep one copy on the device
        return mask

    @functools.cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 offsets of every document of the flattened batch, then the total token count."""
        starts = (self.position_ids == 0).flatten()
        starts[:: self.position_ids.shape[-1]] = True  # every row begins a sequence
        # nonzero synchronizes with the host, once per forward
        total = starts.new_tensor([starts.numel()], dtype=torch.long)
        return torch.cat([starts.nonzero().flatten(), total]).to(torch.int32)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) block-causal mask of packed rows: True where a token may attend."""
    doc = (position_ids == 0).cumsum(-1)  # (B, T): document number within the row
    T = position_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def _rope_inv_freq(head_dim: int, base: float, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies 1 / base^(2i/d) for i in [0, d/2), in float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (base**exponents)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Map the two halves (x1, x2) of the last dim to (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) by the per-position angles cos, sin: (T, D), or (B, T, D) for per-row positions."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (B or 1, T, 1, D) broadcasts over heads
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)

    def param_inits(self) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        yield self.weight, nn.init.ones_


class Attention(nn.Module, ExchangesSequence):
    """Causal grouped-query self-attention with rotary position embeddings; under isp it exchanges heads for
    sequence around attending (`sequence_exchange`, model/hooks.py)."""

    def __init__(
        self,
        hidden_size: int,
        n_heads: int,
        n_kv_heads: int,
        attn_impl: str,
        bias: bool = False,
        *,
        head_dim: int | None = None,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        o_bias: bool | None = None,
    ) -> None:
        """`bias` is on wq, wk, wv, and on wo unless `o_bias` says otherwise (Qwen2: q, k, v only). `head_dim`
        defaults to hidden_size / n_heads (Qwen3 sets its own); `qk_norm` RMS-normalises q and k per head."""
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim or hidden_size // n_heads
        self.attn_impl = attn_impl
        self.wq = nn.Linear(hidden_size, n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(hidden_size, n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(hidden_size, n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * self.head_dim, hidden_size, bias=bias if o_bias is None else o_bias)
        # Qwen3: RMSNorm over each head's dim, before RoPE; one weight shared by all heads
        self.q_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None

    def _use_flash(self, x: torch.Tensor) -> bool:
        """Whether this call goes to flash-attn (decided per call from the activation)."""
        if self.attn_impl == "flash":
            return True
        if self.attn_impl == "sdpa":
            return False
        on_gpu_half = x.device.type == "cuda" and x.dtype in (torch.float16, torch.bfloat16)
        return on_gpu_half and _flash_attn_func() is not None

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], documents: Documents | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallel each rank holds whole heads of its column shard of wq/wk/wv
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, H, D)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, KVH, D)
        v = self.wv(x).view(B, T, -1, self.head_dim)  # (B, T, KVH, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        exchange = self.sequence_exchange
        if exchange is not None:  # isp: this rank's tokens of all heads -> all tokens of its heads
            q, k, v = (exchange(t, scatter_dim=2, gather_dim=1) for t in (q, k, v))
        out = self._attend(q, k, v, documents, x)
        if exchange is not None:
            out = exchange(out, scatter_dim=1, gather_dim=2)
        return self.wo(out.reshape(B, T, -1))  # (B, T, C)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None, x: torch.Tensor
    ) -> torch.Tensor:
        """Causal attention (within documents) of (B, S, H, D) queries over (B, S, KVH, D) keys and values."""
        B, S = q.shape[:2]
        if self._use_flash(x) and documents is not None:
            # varlen over the flattened batch; S bounds every document's length (no host sync for the max)
            cu = documents.cu_seqlens
            flat = (t.flatten(0, 1) for t in (q, k, v))  # (B*S, H or KVH, D)
            out = _flash_attn_varlen_func()(*flat, cu, cu, S, S, causal=True).view(B, S, -1, self.head_dim)
        elif self._use_flash(x):
            # flash-attn takes (B, T, H, D) and handles fewer kv heads itself
            out = _flash_attn_func()(q, k, v, causal=True)  # (B, T, H, D)
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H or KVH, S, D)
            if documents is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, S, D)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=documents.mask, enable_gqa=True)
            out = out.transpose(1, 2)  # (B, S, H, D)
        return out

    def param_inits(self, std: float, out_std: float) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        """normal(0, std) for wq, wk, wv; normal(0, out_std) for wo, which writes into the residual stream;
        biases (if any) to zero."""
        for lin in (self.wq, self.wk, self.wv):
            yield lin.weight, normal_init(std)
        yield self.wo.weight, normal_init(out_std)
        for lin in (self.wq, self.wk, self.wv, self.wo):
            if lin.bias is not None:
                yield lin.bias, nn.init.zeros_
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                yield from norm.param_inits()


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then h + ffn(norm(h))."""

    def __init__(
        self,
        hidden_size: int,
        n_heads: int,
        n_kv_heads: int,
        intermediate_size: int,
        norm_eps: float,
        attn_impl: str,
        attention_bias: bool = False,
        *,
        attention_kwargs: dict[str, Any] | None = None,
        moe: MoE | None = None,
    ) -> None:
        """`moe` replaces the dense feed-forward (a sparse block); `attention_kwargs` go to `Attention`."""
        super().__init__()
        self.attention_norm = RMSNorm(hidden_size, norm_eps)
        self.attention = Attention(
            hidden_size,
            n_heads,
            n_kv_heads,
            attn_impl,
            bias=attention_bias,
            norm_eps=norm_eps,
            **(attention_kwargs or {}),
        )
        self.ffn_norm = RMSNorm(hidden_size, norm_eps)
        self.feed_forward = moe if moe is not None else FeedForward(hidden_size, intermediate_size)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], documents: Documents | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, documents)
        return h + self.feed_forward(self.ffn_norm(h))

    def param_inits(self, std: float, out_std: float) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        """Norms to ones, linears as in Attention/FeedForward.param_inits."""
        yield from self.attention_norm.param_inits()
        yield from self.attention.param_inits(std, out_std)
        yield from self.ffn_norm.param_inits()
        yield from self.feed_forward.param_inits(std, out_std)


def _validate_args(**args: Any) -> None:
    """Raise ValueError naming the first bad InternLM2 constructor argument and its value."""
    int_args = (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_kv_attention_heads",
        "vocab_size",
        "multiple_of",
    )
    for name in int_args:
        value = args[name]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")
    for name in ("mlp_ratio", "norm_eps", "rope_base", "init_std"):
        value = args[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive number")
    heads, kv_heads, hidden = args["num_attention_heads"], args["num_kv_attention_heads"], args["hidden_size"]
    if heads % kv_heads != 0:
        raise ValueError(f"num_attention_heads={heads} must be divisible by num_kv_attention_heads={kv_heads}")
    head_dim = args["head_dim"]
    if head_dim is not None:
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"head_dim={head_dim!r} must be a positive even int (RoPE rotates pairs)")
    elif hidden % heads != 0:
        raise ValueError(f"hidden_size={hidden} must be divisible by num_attention_heads={heads}")
    elif (hidden // heads) % 2 != 0:
        raise ValueError(f"hidden_size={hidden} / num_attention_heads={heads} is odd; RoPE needs an even head_dim")
    attn_impl = args["attn_impl"]
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl={attn_impl!r} must be one of {ATTN_IMPLS}")
    if attn_impl == "flash" and _flash_attn_func() is None:
        raise ValueError("attn_impl='flash' but flash_attn is not importable: pip install flash-attn, or use 'auto'")


def decoder_block_plan(kv_heads: int, sparse: bool) -> BlockPlan:
    """`DecoderLayer`'s modules by tensor-parallel role (model/tensor_plan.py)."""
    if sparse:
        feed_forward = Region("feed_forward")
    else:
        feed_forward = Region("feed_forward", column=("feed_forward.w1", "feed_forward.w3"), row=("feed_forward.w2",))
    return BlockPlan(
        attention=Region("attention", column=("attention.wq",), row=("attention.wo",), extra_args=2),  # rope, documents
        kv=("attention.wk", "attention.wv"),
        kv_heads=kv_heads,
        feed_forward=feed_forward,
        sparse=sparse,
        norms=("attention_norm", "ffn_norm"),
    )


class InternLM2(nn.Module, HasTensorPlan, ShardsSequence):
    """Decoder-only LM: tok_embeddings -> layers -> norm -> output. Under isp it keeps its rank's chunk of the
    sequence (`sequence_shard`, model/hooks.py)."""

    def __init__(
        self,
        *,
        num_layers: int,
        hidden_size: int,
        num_attention_heads: int,
        num_kv_attention_heads: int,
        vocab_size: int,
        mlp_ratio: float = 8 / 3,
        multiple_of: int = 64,
        norm_eps: float = 1e-6,
        rope_base: float = 10000.0,
        tie_word_embeddings: bool = False,
        init_std: float = 0.02,
        attn_impl: str = "auto",
        attention_bias: bool = False,
        qkv_bias: bool | None = None,
        o_bias: bool | None = None,
        head_dim: int | None = None,
        qk_norm: bool = False,
        num_experts: int = 0,
        top_k: int = 1,
        moe_type: str = "GShard",
        num_shared_experts: int = 0,
        shared_expert_gate: str = "softmax",
        moe_layer_kwargs: dict[str, Any] | None = None,
        mlp_only_layers: tuple[int, ...] = (),
        decoder_sparse_step: int = 1,
        dense_intermediate_size: int | None = None,
    ) -> None:
        """`qkv_bias`/`o_bias` (default: `attention_bias`) put biases on wq, wk, wv / wo apart. `num_experts > 0`
        makes the blocks sparse (model/moe.py), except those in `mlp_only_layers` or off the `decoder_sparse_step`
        (Qwen's rule: block i is sparse iff (i + 1) % step == 0), which get a dense SwiGLU of
        `dense_intermediate_size` (default: the expert width). `moe_layer_kwargs`: capacity_factor, min_capacity,
        drop_tokens (GShard); normalize_expert_weights, scoring_func, routed_scaling_factor (Dropless);
        aux_loss_by_layer (False: transformers' global loss over all layers)."""
        super().__init__()
        _validate_args(
            num_layers=num_layers,
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            num_kv_attention_heads=num_kv_attention_heads,
            vocab_size=vocab_size,
            multiple_of=multiple_of,
            mlp_ratio=mlp_ratio,
            norm_eps=norm_eps,
            rope_base=rope_base,
            init_std=init_std,
            attn_impl=attn_impl,
            head_dim=head_dim,
        )
        head_dim = head_dim or hidden_size // num_attention_heads

        self.num_layers = num_layers
        self.vocab_size = vocab_size
        self.head_dim = head_dim
        self.rope_base = rope_base
        self.init_std = init_std
        self.tie_word_embeddings = tie_word_embeddings
        self.num_kv_heads = num_kv_attention_heads
        intermediate = intermediate_size(hidden_size, mlp_ratio, multiple_of)
        moe_kwargs = dict(moe_layer_kwargs or {})
        self.num_experts = num_experts
        self.top_k = top_k
        self.moe_type = moe_type
        self.aux_loss_by_layer = moe_kwargs.pop("aux_loss_by_layer", True)

        def sparse(i: int) -> bool:
            return num_experts > 0 and i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0

        # by the config, not by the blocks' classes: a block that should be sparse and is not is refused, not skipped
        self.sparse_layers = tuple(i for i in range(num_layers) if sparse(i))

        def moe_block() -> MoE:
            return MoE(
                hidden_size,
                intermediate,
                num_experts,
                top_k,
                moe_type=moe_type,
                num_shared_experts=num_shared_experts,
                shared_expert_gate=shared_expert_gate,
                **moe_kwargs,
            )

        dense_width = dense_intermediate_size or intermediate
        attention_kwargs = {
            "head_dim": head_dim,
            "qk_norm": qk_norm,
            "o_bias": attention_bias if o_bias is None else o_bias,
        }
        qkv_bias = attention_bias if qkv_bias is None else qkv_bias

        # Built on meta so construction draws no random numbers: init_weights alone sets every weight, which
        # makes a direct build equal a meta build + to_empty + init_weights under the same seed.
        device = torch.get_default_device()
        with torch.device("meta"):
            self.tok_embeddings = nn.Embedding(vocab_size, hidden_size)
            self.layers = nn.ModuleList(
                DecoderLayer(
                    hidden_size,
                    num_attention_heads,
                    num_kv_attention_heads,
                    dense_width,
                    norm_eps,
                    attn_impl,
                    qkv_bias,
                    attention_kwargs=attention_kwargs,
                    moe=moe_block() if sparse(i) else None,
                )
                for i in range(num_layers)
            )
            self.norm = RMSNorm(hidden_size, norm_eps)
            self.output = nn.Linear(hidden_size, vocab_size, bias=False)
            # Non-persistent: derived from config, so checkpoints hold only parameters.
            self.register_buffer("inv_freq", _rope_inv_freq(head_dim, rope_base), persistent=False)
        if tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.to_empty(device=device)
        self.init_weights()

    def init_weights(self, apply: ApplyInit | None = None) -> None:
        """Reset RoPE and set every weight from the current torch RNG (normal(0, init_std); residual outputs
        scaled), one parameter at a time in `param_inits` order. `apply(param, init)` replaces `init(param)`:
        a sharded build draws each parameter whole and keeps its shard, so it draws what this one does."""
        if self.tie_word_embeddings and self.output.weight is not self.tok_embeddings.weight:
            # to_empty from meta makes a new Parameter per module, which unties a shared weight
            self.output.weight = self.tok_embeddings.weight
        with torch.no_grad():
            self.inv_freq.copy_(_rope_inv_freq(self.head_dim, self.rope_base, self.inv_freq.device))
            for param, init in self.param_inits():
                if apply is None:
                    init(param)
                else:
                    apply(param, init)

    def param_inits(self) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        """Every parameter (a tied one once) with its init, in the order the seeded draws happen."""
        yield self.tok_embeddings.weight, normal_init(self.init_std)
        # GPT-2: shrink the projections that write into the residual stream so its variance stays flat in depth.
        out_std = self.init_std / math.sqrt(2 * self.num_layers)
        for layer in self.layers:
            yield from layer.param_inits(self.init_std, out_std)
        yield from self.norm.param_inits()
        if not self.tie_word_embeddings:
            yield self.output.weight, normal_init(self.init_std)

    def rope_cos_sin(
        self, seq_len: int, dtype: torch.dtype, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for positions 0..T-1, each (T, head_dim), or for `position_ids` (B, T), each (B, T, head_dim).

        Computed in float32, cast to `dtype`.
        """
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:  # model.to(bf16) casts buffers; bf16 frequencies skew long-T angles
            inv_freq = _rope_inv_freq(self.head_dim, self.rope_base, inv_freq.device)
        if position_ids is None:
            positions = torch.arange(seq_len, dtype=torch.float32, device=inv_freq.device)
        else:
            positions = position_ids.to(inv_freq.device, torch.float32)
        freqs = positions[..., None] * inv_freq  # (..., T, D/2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (..., T, D): rotate-half pairs dim i with i + D/2
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> ModelOutput:
        """Logits (B, T, V) for input_ids (B, T), in the model's dtype; with experts also the load-balancing loss
        (`moe_aux`: an fp32 scalar without its coefficient).

        `position_ids` (B, T) packs several documents per row: positions restart at 0 where a document
        begins, and attention never crosses into another document. With a `sequence_shard` (isp) the
        logits are this rank's chunk of the sequence, (B, T / shard.size, V).
        """
        documents = None if position_ids is None else Documents(position_ids)  # the whole sequence's
        shard = self.sequence_shard
        if shard is not None:  # isp: this rank's chunk of the tokens, at their own positions
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
            input_ids, position_ids = shard.local(input_ids), shard.local(position_ids)
        h = self.tok_embeddings(input_ids)  # (B, T, C)
        rope = self.rope_cos_sin(input_ids.shape[1], h.dtype, position_ids)
        with self._router_stats() as stats:
            for layer in self.layers:
                h = layer(h, rope, documents)
        logits = self.output(self.norm(h))  # (B, T, V)
        if self.num_experts == 0:
            return ModelOutput(logits)
        return ModelOutput(logits, {MOE_AUX: self.aux_loss(stats)})

    def tensor_plan(self) -> TensorPlan:
        """Where tensor parallel, isp and expert parallel find this decoder's modules (model/tensor_plan.py)."""
        blocks = tuple(decoder_block_plan(self.num_kv_heads, i in self.sparse_layers) for i in range(self.num_layers))
        return TensorPlan(embedding="tok_embeddings", final_norm="norm", head="output", blocks=blocks)

    def moe_layers(self) -> list[MoE]:
        """The sparse blocks' feed-forwards, in depth order."""
        return [layer.feed_forward for layer in self.layers if isinstance(layer.feed_forward, MoE)]

    @contextlib.contextmanager
    def _router_stats(self) -> Iterator[list[RouterStats]]:
        """This forward's router statistics in depth order, the sparse blocks' tokens per expert recorded after.

        Only this forward fills the list: a block recomputed in backward finds no sink and keeps no graph alive.
        """
        stats: list[RouterStats] = []
        moes = self.moe_layers()
        for moe in moes:
            moe.stats_sink = stats
        try:
            yield stats
        finally:
            for moe in moes:
                moe.stats_sink = None
        for moe in moes:
            moe.record_load()

    def aux_loss(self, stats: list[RouterStats]) -> torch.Tensor:
        """The load-balancing loss without its coefficient: InternEvo's per layer, summed over layers (1 per layer
        for a uniform router), or transformers' global one when `aux_loss_by_layer=False` (about top_k)."""
        if not stats:  # every block dense (mlp_only_layers)
            return torch.zeros((), device=self.output.weight.device)
        if not self.aux_loss_by_layer:
            return global_aux_loss(stats, self.num_experts)
        if self.moe_type == "GShard":
            return torch.stack([gshard_aux_loss(s, self.num_experts) for s in stats]).sum()
        return torch.stack([dropless_aux_loss(s, self.num_experts, self.top_k) for s in stats]).sum()

    def tokens_per_expert(self) -> torch.Tensor:
        """(sparse blocks, E) fp32: tokens each expert computed in the last forward, after capacity (detached)."""
        return torch.stack([moe.tokens_per_expert for moe in self.moe_layers()])

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count (tied weights once); exclude_embeddings drops the tok_embeddings table."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_embeddings.weight.numel()
        return n
