"""Token copies grouped by expert and back: gathers whose backward is a gather too.

Both directions are permutations of the T*k token copies, so each backward reads every gradient row exactly
once: a gather by the inverse permutation, no zero-filled buffer and no accumulating `index_put` (which is
nondeterministic on some devices and needs a fill first). Only `order` is saved for backward, shared by both.
"""

from typing import Any

import torch


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """`inverse[order[i]] = i` (no host sync)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


class PermuteRows(torch.autograd.Function):
    """rows[i] = x[order[i] // k]: x (T, H) to its T*k copies sorted by `order`; backward sums each token's k
    copies in choice order (what `x.repeat_interleave(k)[order]`'s backward computes, without its zero fill)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.k = k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (order,) = ctx.saved_tensors
        per_copy = grad.index_select(0, inverse_permutation(order))  # (T*k, H) in (token, choice) order
        return per_copy.view(-1, ctx.k, grad.shape[-1]).sum(1), None, None


class UnpermuteRows(torch.autograd.Function):
    """flat[j] = rows[inverse[j]]: the sorted copies back in (token, choice) order; backward gathers by `order`."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(order)
        return rows.index_select(0, inverse_permutation(order))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order), None
