"""Attention the decoder families share: packed documents, the kernel dispatch (sdpa / flash-attn), and grouped-query
self-attention with rotary embeddings (InternLM2, Llama, Qwen2/3, GLM-4.5: biases, head_dim, q/k norms and partial
rotary as options; GPT-OSS: sliding windows and attention sinks, `attend_masked`).

Another attention module (model/mla.py's multi-head latent attention) takes the same (x, rope, documents) and calls
`attend` for the kernel; under isp it declares `ExchangesSequence` (model/hooks.py) and exchanges heads around it.
"""

import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from internlm_offload.model.hooks import ExchangesSequence
from internlm_offload.model.mlp import ParamInit, normal_init
from internlm_offload.model.norm import RMSNorm
from internlm_offload.model.rope import apply_partial_rope, apply_rope
from internlm_offload.offload.activation import mark_not_offload

ATTN_IMPLS = ("sdpa", "flash", "auto")


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
        # what a block hands to later blocks of the same forward (DSA's top-k, model/dsa.py), by key
        self.shared: dict[object, torch.Tensor] = {}
        self._masks: dict[tuple[int | None, bool], torch.Tensor] = {}

    def window_mask(self, window: int | None, sink_column: bool = False) -> torch.Tensor:
        """(B, 1, T, T) `mask` narrowed to the last `window` keys of each query, itself included (GPT-OSS's
        sliding layers: 0 <= q - k < window; None: the whole document), with `sink_column` the sinks' column first
        ((B, 1, T, T + 1), `with_sink_column`); computed once per forward, shared by the blocks that ask alike."""
        key = (window, sink_column)
        if key not in self._masks:
            mask = self.mask
            if window is not None:
                mask = mask & sliding_window(self.position_ids.shape[-1], window, self.position_ids.device)
            if sink_column:
                mask = with_sink_column(mask)
            mark_not_offload(mask)
            self._masks[key] = mask
        return self._masks[key]

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


def sliding_window(seq_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(T, T) causal mask, narrowed to keys 0 <= q - k < `window` (None: every earlier key)."""
    distance = torch.arange(seq_len, device=device)[:, None] - torch.arange(seq_len, device=device)[None]
    allowed = distance >= 0
    return allowed if window is None else allowed & (distance < window)


# A sink below this is taken as this (its share is exactly 0 in fp32 and wider): -inf would make 0 * -inf = NaN
# in the augmented dot products of `attend_masked`.
SINK_FLOOR = -1e30


def with_sink_column(allowed: torch.Tensor) -> torch.Tensor:
    """`allowed` (..., S, S) with a first column of True: every query sees its head's sink key (`attend_masked`)."""
    return torch.cat((torch.ones_like(allowed[..., :1]), allowed), dim=-1)


def attend_masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of (B, S, H, D) queries over (B, S, KVH, D) keys and (B, S, KVH, Dv) values where `allowed` ((B, 1,
    S, S) or (S, S), True: may attend; with sinks it may already carry `with_sink_column`'s column) says, with
    per-head `sinks` (H,): a learned logit each query head adds to its softmax's denominator only (a key whose value
    is zero), not scaled. (B, S, H, Dv) out.

    One SDPA call either way (its fused kernels keep O(S) per head, no (S, S) probabilities saved). The sinks ride in
    as one more key per kv head at position 0 whose value is zero: each of a kv head's g query heads gets a one-hot
    extra dim (q' = [q, e_m]), real keys zeros there (k' = [k, 0]: q'.k' = q.k exactly), the sink key [0, s_j g.. /
    scale], so q'.k_sink x scale = the head's sink."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dv = v.shape[-1]
    if sinks is not None:
        q, k, v, allowed = _with_sink_keys(q, k, v, allowed, sinks, scale)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H or KVH, S, D)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)[..., :dv]


def _with_sink_keys(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor, scale: float
) -> tuple[torch.Tensor, ...]:
    """q, k, v and the mask of `attend_masked` with the sinks as one more key per kv head (q and k g dims wider, v
    zero-padded to their width so that every SDPA kernel takes it; the output is sliced back)."""
    B, S, H, D = q.shape
    kv_heads = k.shape[2]
    g = H // kv_heads  # query heads per kv head: kv head j serves queries j*g ... j*g + g - 1
    one_hot = torch.eye(g, dtype=q.dtype, device=q.device).repeat(kv_heads, 1)  # (H, g): row h = e_(h mod g)
    q = torch.cat((q, one_hot.expand(B, S, H, g)), dim=-1)
    k = torch.cat((k, k.new_zeros(B, S, kv_heads, g)), dim=-1)
    sink_keys = torch.cat((k.new_zeros(kv_heads, D), (sinks.clamp(min=SINK_FLOOR) / scale).view(kv_heads, g)), -1)
    k = torch.cat((sink_keys.to(k.dtype).expand(B, 1, kv_heads, D + g), k), dim=1)  # (B, S + 1, KVH, D + g)
    v = F.pad(v, (0, D + g - v.shape[-1], 0, 0, 1, 0))  # a zero value for the sink key (S + 1), width D + g
    if allowed.shape[-1] == S:
        allowed = with_sink_column(allowed)
    return q, k, v, allowed


def check_attn_impl(attn_impl: str) -> None:
    """ValueError naming an attention implementation that is not one of ATTN_IMPLS or cannot run here."""
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl={attn_impl!r} must be one of {ATTN_IMPLS}")
    if attn_impl == "flash" and _flash_attn_func() is None:
        raise ValueError("attn_impl='flash' but flash_attn is not importable: pip install flash-attn, or use 'auto'")


def uses_flash(attn_impl: str, x: torch.Tensor) -> bool:
    """Whether a call on activation `x` goes to flash-attn (`auto`: half precision on a cuda device, if installed)."""
    if attn_impl == "flash":
        return True
    if attn_impl == "sdpa":
        return False
    on_gpu_half = x.device.type == "cuda" and x.dtype in (torch.float16, torch.bfloat16)
    return on_gpu_half and _flash_attn_func() is not None


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: Documents | None,
    *,
    flash: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention (within documents) of (B, S, H, D) queries over (B, S, KVH, D) keys and (B, S, KVH, Dv)
    values: (B, S, H, Dv). `scale` multiplies q.k before the softmax (None: D^-0.5)."""
    if flash and v.shape[-1] != q.shape[-1]:
        return _flash_with_padded_heads(q, k, v, documents, scale)
    B, S = q.shape[:2]
    if flash and documents is not None:
        # varlen over the flattened batch; S bounds every document's length (no host sync for the max)
        cu = documents.cu_seqlens
        flat = (t.flatten(0, 1) for t in (q, k, v))  # (B*S, H or KVH, D)
        out = _flash_attn_varlen_func()(*flat, cu, cu, S, S, softmax_scale=scale, causal=True)
        return out.view(B, S, -1, v.shape[-1])
    if flash:
        # flash-attn takes (B, T, H, D) and fewer kv heads itself
        return _flash_attn_func()(q, k, v, softmax_scale=scale, causal=True)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H or KVH, S, D)
    if documents is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)  # (B, H, S, Dv)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=documents.mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)  # (B, S, H, Dv)


def _flash_with_padded_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None, scale: float | None
) -> torch.Tensor:
    """flash-attn of values apart from q and k in width (MLA: Dv != D): it takes one head width, so the narrower
    side is zero-padded (XTuner pads v) and the output sliced back to Dv. Zero columns of v give zero outputs, zero
    columns of q and k add nothing to q.k; the scale stays the unpadded D's."""
    d, dv = q.shape[-1], v.shape[-1]
    width = max(d, dv)
    q, k, v = (t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    out = attend(q, k, v, documents, flash=True, scale=d**-0.5 if scale is None else scale)
    return out[..., :dv]


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
        rotary_dim: int | None = None,
        sinks: bool = False,
        window: int | None = None,
        output_gate: bool = False,
        zero_centred_qk_norm: bool = False,
    ) -> None:
        """`bias` is on wq, wk, wv, and on wo unless `o_bias` says otherwise (Qwen2, GLM-4.5: q, k, v only).
        `head_dim` defaults to hidden_size / n_heads (Qwen3 sets its own); `qk_norm` RMS-normalises q and k per head.
        RoPE rotates the first `rotary_dim` dims of each head (default all; GLM-4.5 half) and passes the rest.
        GPT-OSS: `sinks` learns one softmax-denominator logit per query head (`attend_masked`); `window` lets a query
        see its last `window` keys (itself included) within its document. Either takes the masked path whatever
        `attn_impl` says (flash-attn has no sinks). Qwen3-Next: `output_gate` makes wq write each head's query then its
        gate ([q | gate] per head) and the output is attention * sigmoid(gate) before wo; `zero_centred_qk_norm`
        makes the q/k norms (1 + w)."""
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim or hidden_size // n_heads
        self.rotary_dim = self.head_dim if rotary_dim is None else rotary_dim
        if self.rotary_dim > self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and at most head_dim={self.head_dim}")
        self.attn_impl = attn_impl
        self.output_gate = output_gate
        self.wq = nn.Linear(hidden_size, n_heads * self.head_dim * (2 if output_gate else 1), bias=bias)
        self.wk = nn.Linear(hidden_size, n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(hidden_size, n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * self.head_dim, hidden_size, bias=bias if o_bias is None else o_bias)
        # Qwen3: RMSNorm over each head's dim, before RoPE; one weight shared by all heads
        self.q_norm = RMSNorm(self.head_dim, norm_eps, zero_centred_qk_norm) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, norm_eps, zero_centred_qk_norm) if qk_norm else None
        self.window = window
        self.sinks = nn.Parameter(torch.empty(n_heads)) if sinks else None

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], documents: Documents | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallel each rank holds whole heads of its column shard of wq/wk/wv
        gate = None
        if self.output_gate:  # per head [query | gate]
            q, gate = self.wq(x).view(B, T, -1, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, H, D)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, KVH, D)
        v = self.wv(x).view(B, T, -1, self.head_dim)  # (B, T, KVH, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rotate = apply_rope if self.rotary_dim == self.head_dim else apply_partial_rope
        cos, sin = rope
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        exchange = self.sequence_exchange
        if exchange is not None:  # isp: this rank's tokens of all heads -> all tokens of its heads
            q, k, v = (exchange(t, scatter_dim=2, gather_dim=1) for t in (q, k, v))
        if self.sinks is None and self.window is None:
            out = attend(q, k, v, documents, flash=uses_flash(self.attn_impl, x))
        else:
            out = attend_masked(q, k, v, self._allowed(documents, q.shape[1], x.device), self._own_sinks())
        if exchange is not None:
            out = exchange(out, scatter_dim=1, gather_dim=2)
        out = out.reshape(B, T, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(B, T, -1))
        return self.wo(out)  # (B, T, C)

    def _own_sinks(self) -> torch.Tensor | None:
        """The sinks of the query heads this rank attends with: under tensor parallel its shard (split with the
        heads: engine/tensor_parallel.py `split_with_heads`), under isp its chunk of the whole (the heads the
        exchange hands it), else all."""
        sinks = self.sinks
        if isinstance(sinks, DTensor):
            return sinks.to_local()
        if sinks is not None and self.sequence_exchange is not None:
            return self.sequence_exchange.own_heads(sinks, dim=0)
        return sinks

    def _allowed(self, documents: Documents | None, seq_len: int, device: torch.device) -> torch.Tensor:
        """Where a query may attend: within its document, causal, within the window (if any); the sinks' column
        first where it has sinks."""
        sink_column = self.sinks is not None
        if documents is None:
            allowed = sliding_window(seq_len, self.window, device)
            return with_sink_column(allowed) if sink_column else allowed
        return documents.window_mask(self.window, sink_column)

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
        if self.sinks is not None:  # transformers draws GPT-OSS's sinks normal(0, initializer_range)
            yield self.sinks, normal_init(std)
