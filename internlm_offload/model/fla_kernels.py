"""The flash-linear-attention kernels for the gated delta rule, an optional extra (`pip install
flash-linear-attention`, cuda / triton only), with the torch chunked rule (`gated_deltanet.py`) as the reference.

Called as transformers' Qwen3-Next layer calls it: one flattened row (1, N, H, d) with `cu_seqlens` at every
document start, so the kernel restarts the state there exactly as the torch path's chunk layout does; q and k
L2-normalised inside the kernel, q scaled by the kernel's default dk^-1/2. The key heads are repeated to the value
heads before the call (the layout every fla release accepts).
"""

from collections.abc import Callable

import torch

# `model.attn_impl` values that may take the kernels ("sdpa" keeps torch's ops, the reference path)
KERNEL_IMPLS = ("auto", "flash")


def fla_chunk_gated_delta_rule() -> Callable | None:
    """fla's `chunk_gated_delta_rule`, or None when flash-linear-attention is not importable."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def on_accelerator(x: torch.Tensor) -> bool:
    """Whether x lives where fla's triton kernels run (cuda; a test points this elsewhere)."""
    return x.is_cuda


def fla_delta_rule(attn_impl: str, x: torch.Tensor) -> Callable | None:
    """fla's kernel when `attn_impl` allows it, x is on cuda and the package imports; else None (the torch rule)."""
    if attn_impl not in KERNEL_IMPLS or not on_accelerator(x):
        return None
    return fla_chunk_gated_delta_rule()


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """cu_seqlens (int32, D + 1) of the flattened rows: a document starts where its position is 0 and at each row's
    first token, the last entry is the token count."""
    starts = position_ids == 0
    starts[:, 0] = True
    flat = starts.flatten()
    begin = flat.nonzero().flatten()
    return torch.cat([begin, begin.new_tensor([flat.numel()])]).to(torch.int32)


def run_fla(
    kernel: Callable,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """The rule over (B, T, H, d) q, k (raw: normalised and scaled in the kernel), v, and (B, T, H) g, beta, each
    document of a packed row on its own; returns (B, T, H, dv)."""
    B, T = q.shape[:2]
    flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
    out, _ = kernel(
        *flat[:3],
        g=flat[3],
        beta=flat[4],
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=document_starts(position_ids),
    )
    return out.reshape(B, T, *out.shape[2:])
