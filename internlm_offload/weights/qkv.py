"""The attention projections' foreign row orders, as pure tensor maps (exact: only rows move).

InternLM2 (InternEvo and its Hugging Face port) fuses wq, wk, wv into one `wqkv` whose rows come in kv
groups: for each kv head, the `n_heads / n_kv_heads` query heads that share it, then its key head, then its
value head (`(h gs d)` with `gs = q_per_kv + 2`). Tensor parallelism splits the fused rows into contiguous
runs of whole groups, so the full tensor keeps this order.

Meta's Llama checkpoints order each query and key head's rows for RoPE on interleaved pairs (x0, x1), (x2,
x3), ...; the native model rotates halves (x_j with x_{j + d/2}), as Hugging Face's Llama does.
"""

import torch


def fuse_wqkv(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """wq (H*D, C), wk and wv (KVH*D, C) -> InternLM2's wqkv ((H + 2*KVH)*D, C), grouped per kv head."""
    head_dim = wk.shape[0] // n_kv_heads
    q = wq.unflatten(0, (n_kv_heads, -1, head_dim))  # (KVH, q_per_kv, D, C)
    k = wk.unflatten(0, (n_kv_heads, 1, head_dim))
    v = wv.unflatten(0, (n_kv_heads, 1, head_dim))
    return torch.cat((q, k, v), dim=1).flatten(0, 2)


def split_wqkv(wqkv: torch.Tensor, n_heads: int, n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """InternLM2's wqkv -> (wq, wk, wv); the inverse of `fuse_wqkv`."""
    head_dim = wqkv.shape[0] // (n_heads + 2 * n_kv_heads)
    groups = wqkv.unflatten(0, (n_kv_heads, n_heads // n_kv_heads + 2, head_dim))  # (KVH, gs, D, C)
    wq = groups[:, :-2].flatten(0, 2)
    wk = groups[:, -2].flatten(0, 1)
    wv = groups[:, -1].flatten(0, 1)
    return wq.contiguous(), wk.contiguous(), wv.contiguous()


def interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta's RoPE row order -> rotate-half order, per head: rows (0, 1, 2, 3, ...) -> (0, 2, ..., 1, 3, ...)."""
    return w.unflatten(0, (n_heads, -1, 2)).transpose(1, 2).flatten(0, 2).contiguous()


def halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rotate-half row order -> Meta's interleaved one; the inverse of `interleaved_to_halves`."""
    return w.unflatten(0, (n_heads, 2, -1)).transpose(1, 2).flatten(0, 2).contiguous()
