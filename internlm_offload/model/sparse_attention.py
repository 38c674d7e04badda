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

from internlm_offload.model.meta_trace import count_skipped_work, traced_queries

# the gathered elements one query chunk may hold (fp32: 256 MiB); a chunk is at least one query
CHUNK_ELEMENTS = 1 << 26


def query_chunk(k: torch.Tensor, v: torch.Tensor, topk: int) -> int:
    """Queries per chunk: as many as keep a chunk's gathered keys and values within CHUNK_ELEMENTS."""
    heads, width = k.shape[2], k.shape[3] + v.shape[3]
    return max(1, CHUNK_ELEMENTS // (topk * heads * width))


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """(B, T, H, D) -> (B, H, T, D) contiguous: each head's rows together, so a gather reads whole rows and the
    products below are plain batched matmuls (no permuted copies)."""
    return t.transpose(1, 2).contiguous()


def _rows(t: torch.Tensor, safe: torch.Tensor) -> torch.Tensor:
    """(B, H, c, K) row numbers in `t` (B, H, T, D) flattened to rows: head h's key `safe` (B, c, K) of batch row b."""
    B, H, T = t.shape[:3]
    heads = (torch.arange(B, device=t.device)[:, None] * H + torch.arange(H, device=t.device)[None]) * T
    return heads[:, :, None, None] + safe[:, None]


def _gather(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(B, H, c, K, D): the rows of `t` (B, H, T, D) at `rows` (`_rows`)."""
    return t.flatten(0, 2).index_select(0, rows.flatten()).view(*rows.shape, t.shape[-1])


def _scatter_add(into: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """Add `values` (B, H, c, K, D) into `into` (B, H, T, D) at `rows` (`_rows`), in a fixed order."""
    into.view(-1, into.shape[-1]).index_add_(0, rows.flatten(), values.flatten(0, 3).to(into.dtype))


def _accumulate(t: torch.Tensor) -> torch.dtype:
    """The dtype scores, softmax and gradients are summed in: fp32, or the input's if wider (float64 gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def _chunk_scores(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, H, c, K) scaled scores (at least fp32) of a chunk's queries (B, H, c, D) over its gathered keys (B, H, c,
    K, D), -inf in the empty slots (`valid` (B, c, K) False)."""
    scores = torch.matmul(keys, q[..., None]).squeeze(-1).to(_accumulate(q)) * scale
    return scores.masked_fill(~valid[:, None], float("-inf"))


def _picked(indices: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's (valid, safe) slots: where it chose a key, and the positions with -1 read as 0 (masked)."""
    picked = indices[:, start:stop]
    return picked >= 0, picked.clamp(min=0).long()


class SparseAttention(torch.autograd.Function):
    """out (B, T, H, Dv) = softmax over each query's chosen keys of scale q.k, times their values."""

    @staticmethod
    def forward(ctx, q, k, v, indices, scale: float, chunk: int):
        B, T, H, _ = q.shape
        out = q.new_empty(B, T, H, v.shape[-1])
        lse = q.new_empty(B, H, T, dtype=_accumulate(q))
        q_h, k_h, v_h = (_heads_first(t) for t in (q, k, v))  # transients of the forward alone
        traced = traced_queries(q, T, chunk)  # on meta the first chunks (model/meta_trace.py)
        for start in range(0, traced, chunk):
            stop = min(start + chunk, T)
            valid, safe = _picked(indices, start, stop)
            rows = _rows(k_h, safe)
            scores = _chunk_scores(q_h[:, :, start:stop], _gather(k_h, rows), valid, scale)
            lse[:, :, start:stop] = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - lse[:, :, start:stop, None]).to(v.dtype)
            out_c = torch.matmul(probs[..., None, :], _gather(v_h, rows)).squeeze(-2)  # (B, H, c, Dv)
            out[:, start:stop] = out_c.transpose(1, 2)
        topk, width, width_v = indices.shape[-1], q.shape[-1], v.shape[-1]
        count_skipped_work(q, 2 * B * H * (T - traced) * topk * (width + width_v))  # scores, then probs x values
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.scale, ctx.chunk = scale, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, indices, out, lse = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        T = q.shape[1]
        acc = _accumulate(q)
        q_h, k_h, v_h = (_heads_first(t) for t in (q, k, v))
        out_h, grad_h = _heads_first(out).to(acc), _heads_first(grad_out).to(acc)
        grad_q = torch.empty_like(q_h)
        # fp32 (or wider) accumulators: a key chosen by many queries sums many contributions
        grad_k = torch.zeros(k_h.shape, dtype=acc, device=k.device)
        grad_v = torch.zeros(v_h.shape, dtype=acc, device=v.device)
        traced = traced_queries(q, T, chunk)
        for start in range(0, traced, chunk):
            stop = min(start + chunk, T)
            valid, safe = _picked(indices, start, stop)
            rows = _rows(k_h, safe)
            keys, values = _gather(k_h, rows), _gather(v_h, rows)
            q_c, d_out = q_h[:, :, start:stop], grad_h[:, :, start:stop]
            probs = torch.exp(_chunk_scores(q_c, keys, valid, scale) - lse[:, :, start:stop, None])  # (B, H, c, K)
            _scatter_add(grad_v, rows, probs[..., None] * d_out[..., None, :])
            d_probs = torch.matmul(values.to(acc), d_out[..., None]).squeeze(-1)
            row = (d_out * out_h[:, :, start:stop]).sum(-1, keepdim=True)  # (B, H, c, 1)
            d_scores = probs * (d_probs - row) * scale  # zero in the empty slots (probs 0 there)
            grad_q[:, :, start:stop] = torch.matmul(d_scores[..., None, :], keys.to(acc)).squeeze(-2).to(q.dtype)
            _scatter_add(grad_k, rows, d_scores[..., None] * q_c.to(acc)[..., None, :])
        B, H, topk = q.shape[0], q.shape[2], indices.shape[-1]
        width, width_v = q.shape[-1], v.shape[-1]
        count_skipped_work(q, 2 * B * H * (T - traced) * topk * (2 * width + width_v))  # scores, d_probs, grad_q
        back = (t.transpose(1, 2).to(dtype) for t, dtype in ((grad_q, q.dtype), (grad_k, k.dtype), (grad_v, v.dtype)))
        return (*back, None, None, None)


def sparse_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, *, scale: float, chunk: int | None = None
) -> torch.Tensor:
    """(B, T, H, Dv): each query over its `indices` (B, T, K; -1 empty) keys; `chunk` queries at a time (None: as
    `query_chunk` bounds the transient)."""
    if chunk is None:
        chunk = query_chunk(k, v, indices.shape[-1])
    return SparseAttention.apply(q, k, v, indices, scale, chunk)
