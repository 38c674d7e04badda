"""Token copies grouped by expert and back: gathers whose backward is a gather too.

Both directions are permutations of the T*k token copies, so each backward reads every gradient row exactly
once: a gather, no zero-filled buffer and no accumulating `index_put` (which is nondeterministic on some devices
and needs a fill first). `order` is saved for backward, shared by both.
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


class CombineRows(torch.autograd.Function):
    """out[t] = sum_j w[t, j] * rows[inverse[t * k + j]]: the weighted sum of each token's k expert outputs.

    Forward is `(rows[inverse].view(T, k, H) * w[..., None]).sum(1)` itself (torch's reduction order over k kept).
    Backward works on the expert-sorted rows: the same products as autograd's for the multiply, without the
    (T, k, H) gradient in token order and its gather back; only `rows` (not a token-order copy) is saved.
    """

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        T, k = weights.shape
        flat = rows.index_select(0, inverse_permutation(order)).view(T, k, -1)
        ctx.save_for_backward(rows, order, weights)
        return (flat * weights.to(rows.dtype)[..., None]).sum(1)  # freed on return: backward reads `rows`

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
        rows, order, weights = ctx.saved_tensors
        k = weights.shape[1]
        per_row = grad.index_select(0, order // k)  # (T*k, H): each sorted row's token gradient
        w_sorted = weights.to(rows.dtype).reshape(-1).index_select(0, order)
        grad_rows = per_row * w_sorted[:, None]
        grad_w_sorted = (per_row * rows).sum(-1)  # the mul's weight gradient, row by row
        grad_w = torch.empty_like(grad_w_sorted).scatter_(0, order, grad_w_sorted)
        return grad_rows, None, grad_w.view_as(weights).to(weights.dtype)
