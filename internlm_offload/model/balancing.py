"""Load-balancing losses of the bias-balanced sigmoid router (DeepSeek-V3's noaux_tc), beside its bias: XTuner's
balancing loss over the global batch or over this rank's micro-batch, and DeepSeek-V3's sequence-wise balance loss.

Notation: E routed experts, k choices per token, L sparse blocks (layers). Each loss is summed over the layers and
returned without its coefficient (the engine weighs it: `loss.moe_loss_coeff`). The counts are the router's top-k
choices (picked with the bias, as the experts compute them); no gradient flows through them.

- `global_batch` (XTuner's `BalancingLossConfig(balancing_loss_global_average=True)`): per layer,
  E / (T_g k) * sum_e c_e * P_e, where c_e counts layer l's choices of expert e over the tokens of every rank's
  micro-batch (T_g tokens; the counts all-reduced without gradient) and P_e = (1 / T_g) sum_t w_{t,e} is the mean of
  XTuner's router weights w (the biased scores the choice is made on, 0 outside the kept groups, normalised to sum 1
  per token; `BiasRouter.choice_shares`) over the same tokens, their sum all-reduced with autograd (each rank's
  gradient is then the one of the global loss, which the data-parallel average keeps). 1 for a balanced router.
- `micro_batch` (XTuner's `balancing_loss_global_average=False`): the same over this rank's micro-batch alone.
- `sequence` (DeepSeek-V3 report, eq. 17-20, the complementary sequence-wise balance loss): per layer and sequence
  (a row of the micro-batch) of S tokens, sum_e f_e * P_e with f_e = E / (k S) * (choices of e in the row) and
  P_e = (1 / S) sum_t s'_{t,e}, s' the sigmoid scores normalised over all E experts (no bias); averaged over the
  rows. 1 for a balanced router.
"""

import torch

from internlm_offload.model.hooks import RouterStatsPoolFn
from internlm_offload.model.router import RouterStats

BALANCING_LOSSES = ("global_batch", "micro_batch", "sequence")


def balancing_loss(
    kind: str, stats: list[RouterStats], num_experts: int, top_k: int, pool: RouterStatsPoolFn | None = None
) -> torch.Tensor:
    """The `kind` loss (one of BALANCING_LOSSES) of one forward's bias routers, summed over the layers; `pool` sums
    the global batch's statistics over the ranks (model/hooks.py `PoolsRouterStats`; None: this process's
    micro-batch is the whole batch)."""
    if kind == "sequence":
        return sequence_balance_loss(stats, num_experts, top_k)
    counts, shares = choice_statistics(stats)
    tokens = torch.tensor([float(s.tokens) for s in stats], device=counts.device)
    if kind == "global_batch" and pool is not None:
        counts, shares = pool(counts, shares)
        tokens = counts.sum(-1) / top_k  # every rank's tokens (XTuner: the pooled counts over k)
    elif kind not in BALANCING_LOSSES:
        raise ValueError(f"balancing loss {kind!r}: one of {BALANCING_LOSSES}")
    return xtuner_balance_loss(counts, shares, tokens, num_experts, top_k)


def choice_statistics(stats: list[RouterStats]) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, E) top-k choices per expert (no gradient) and (L, E) sums over the tokens of XTuner's router weights."""
    shares = []
    for s in stats:
        if s.choice_shares is None:
            raise ValueError("the balancing losses read the bias router's statistics (BiasRouter)")
        shares.append(s.choice_shares().sum(0))
    return torch.stack([s.topk_counts for s in stats]), torch.stack(shares)


def xtuner_balance_loss(
    counts: torch.Tensor, shares: torch.Tensor, tokens: torch.Tensor, num_experts: int, top_k: int
) -> torch.Tensor:
    """sum over layers of E / (T k) * sum_e counts_e * shares_e / T; counts, shares (L, E), tokens (L,)."""
    mean_share = shares / tokens[:, None]
    scale = num_experts / (tokens * top_k)
    return (scale * (counts * mean_share).sum(-1)).sum()


def sequence_balance_loss(stats: list[RouterStats], num_experts: int, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, summed over layers, averaged over each layer's rows."""
    per_layer = []
    for s in stats:
        if s.routing is None:
            raise ValueError("the balancing losses read the bias router's statistics (BiasRouter)")
        scores = s.routing.scores  # (T, E)
        T, E = scores.shape
        assert T % s.rows == 0, (T, s.rows)
        length = T // s.rows
        shares = (scores / scores.sum(-1, keepdim=True)).view(s.rows, length, E).sum(1)  # (rows, E)
        counts = row_counts(s.routing.indices.view(s.rows, -1), E)  # (rows, E)
        f = num_experts / (top_k * length) * counts
        per_layer.append((f * shares / length).sum(-1).mean())
    return torch.stack(per_layer).sum()


def row_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(rows, E) fp32 count of each expert id in each row of `indices` (rows, n), without a host sync."""
    rows = indices.shape[0]
    offsets = torch.arange(rows, device=indices.device)[:, None] * num_experts
    flat = (indices + offsets).reshape(-1)
    counts = torch.zeros(rows * num_experts, device=indices.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.float32)
    )
    return counts.view(rows, num_experts)
