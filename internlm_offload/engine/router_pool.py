"""The global batch of a mixture of experts' balancing loss: router statistics summed over the ranks inside the loss.

XTuner's global-batch balancing loss (`model.balancing_loss="global_batch"`, model/balancing.py) reads each expert's
choices and the sum of its router weights over every rank's tokens: the counts are summed without gradient, the sums
with autograd, whose backward sums the incoming gradients over the same ranks. Every rank computes the same loss; the
gradient each rank's router weights get is then the ranks' count times that of the global loss, which the
data-parallel average of the gradients (over the same ranks) brings back to the global loss's own.
"""

from typing import Any

import torch
import torch.distributed as dist


class RouterStatsPool:
    """`model/hooks.py` `PoolsRouterStats.stats_pool`: (counts, sums) summed over `group`'s ranks (None: every rank,
    as the router bias update pools its counts: each rank routes tokens of its own)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    def __call__(self, counts: torch.Tensor, sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = counts.detach().clone()
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.group)
        return counts, SumOverRanks.apply(sums, self.group)


class SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces (sums) the gradient: the sum's gradient on every rank is the sum
    of every rank's gradient of it."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return SumOverRanks.apply(grad, ctx.group), None
