"""Attention of each query over its own chosen keys (DeepSeek Sparse Attention's kernel, model/dsa.py): queries
(B, T, H, D), keys (B, T, H, D) and values (B, T, H, Dv) per head as MLA expands them, and per query up to K key
positions (B, T, K) int32, -1 for an empty slot.

Flash-attention's way on the CPU: the forward runs query chunks, gathers each chunk's chosen keys and values, and
keeps only the output and each row's logsumexp; the backward gathers them again per chunk and scatters the key and
value gradients back (index_add, in a fixed order: deterministic). Saved for backward: q, k, v (what dense attention
saves), the output, the logsumexp (T x H) and the indices (T x K int32): O(T x K), no T x T term and no gathered
copy. The transient of a chunk is its gathered keys and values, c x K x H x (D + Dv), c chosen to bound it.
"""

import torch

# the gathered elements one query chunk may hold (fp32: 256 MiB); a chunk is at least one query
CHUNK_ELEMENTS = 1 << 26


def query_chunk(k: torch.Tensor, v: torch.Tensor, topk: int) -> int:
    """Queries per chunk: as many as keep a chunk's gathered keys and values within CHUNK_ELEMENTS."""
    heads, width = k.shape[2], k.shape[3] + v.shape[3]
    return max(1, CHUNK_ELEMENTS // (topk * heads * width))


def _gather(t: torch.Tensor, safe: torch.Tensor) -> torch.Tensor:
    """(B, c, K, H, D): the rows of `t` (B, T, H, D) at `safe` (B, c, K) positions of the same batch row."""
    rows = torch.arange(t.shape[0], device=t.device)[:, None, None]
    return t[rows, safe]


def _scatter_add(into: torch.Tensor, safe: torch.Tensor, rows: torch.Tensor) -> None:
    """Add `rows` (B, c, K, H, D) into `into` (B, T, H, D) at `safe` (B, c, K) positions of the same batch row."""
    B, T = into.shape[:2]
    flat = (safe + torch.arange(B, device=safe.device)[:, None, None] * T).flatten()
    into.view(B * T, *into.shape[2:]).index_add_(0, flat, rows.flatten(0, 2).to(into.dtype))


def _accumulate(t: torch.Tensor) -> torch.dtype:
    """The dtype scores, softmax and gradients are summed in: fp32, or the input's if wider (float64 gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def _chunk_scores(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, c, H, K) scaled scores (at least fp32) of a chunk's queries over its gathered keys, -inf in the empty
    slots."""
    scores = torch.einsum("bchd,bckhd->bchk", q, keys).to(_accumulate(q)) * scale
    return scores.masked_fill(~valid[:, :, None, :], float("-inf"))


class SparseAttention(torch.autograd.Function):
    """out (B, T, H, Dv) = softmax over each query's chosen keys of scale q.k, times their values."""

    @staticmethod
    def forward(ctx, q, k, v, indices, scale: float, chunk: int):
        B, T, H, _ = q.shape
        out = q.new_empty(B, T, H, v.shape[-1])
        lse = q.new_empty(B, T, H, dtype=_accumulate(q))
        for start in range(0, T, chunk):
            stop = min(start + chunk, T)
            picked = indices[:, start:stop]
            valid, safe = picked >= 0, picked.clamp(min=0).long()
            scores = _chunk_scores(q[:, start:stop], _gather(k, safe), valid, scale)
            lse[:, start:stop] = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - lse[:, start:stop, :, None]).to(v.dtype)
            out[:, start:stop] = torch.einsum("bchk,bckhd->bchd", probs, _gather(v, safe))
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.scale, ctx.chunk = scale, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, indices, out, lse = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        T = q.shape[1]
        grad_q = torch.empty_like(q)
        # fp32 (or wider) accumulators: a key chosen by many queries sums many contributions
        acc = _accumulate(q)
        grad_k = torch.zeros(k.shape, dtype=acc, device=k.device)
        grad_v = torch.zeros(v.shape, dtype=acc, device=v.device)
        for start in range(0, T, chunk):
            stop = min(start + chunk, T)
            picked = indices[:, start:stop]
            valid, safe = picked >= 0, picked.clamp(min=0).long()
            keys, values = _gather(k, safe), _gather(v, safe)
            q_c, d_out = q[:, start:stop], grad_out[:, start:stop].to(acc)
            probs = torch.exp(_chunk_scores(q_c, keys, valid, scale) - lse[:, start:stop, :, None])  # (B, c, H, K)
            _scatter_add(grad_v, safe, torch.einsum("bchk,bchd->bckhd", probs, d_out))
            d_probs = torch.einsum("bchd,bckhd->bchk", d_out, values.to(acc))
            row = (d_out * out[:, start:stop].to(acc)).sum(-1, keepdim=True)  # (B, c, H, 1)
            d_scores = probs * (d_probs - row) * scale  # zero in the empty slots (probs 0 there)
            grad_q[:, start:stop] = torch.einsum("bchk,bckhd->bchd", d_scores, keys.to(acc)).to(q.dtype)
            _scatter_add(grad_k, safe, torch.einsum("bchk,bchd->bckhd", d_scores, q_c.to(acc)))
        return grad_q, grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None


def sparse_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, *, scale: float, chunk: int | None = None
) -> torch.Tensor:
    """(B, T, H, Dv): each query over its `indices` (B, T, K; -1 empty) keys; `chunk` queries at a time (None: as
    `query_chunk` bounds the transient)."""
    if chunk is None:
        chunk = query_chunk(k, v, indices.shape[-1])
    return SparseAttention.apply(q, k, v, indices, scale, chunk)
