"""The load-balancing losses `model.balancing_loss` names: XTuner's balancing loss over the global batch or over this
rank's micro-batch and DeepSeek-V3's sequence-wise balance loss (the bias-balanced sigmoid router, DeepSeek-V3's
noaux_tc, beside its bias; XTuner's two for softmax routers too), and transformers' `load_balancing_loss_func`
(softmax routers: Qwen3-Next, Qwen3.5-MoE, GPT-OSS, which transformers adds with `output_router_logits`).

Notation: E routed experts, k choices per token, L sparse blocks (layers). Each loss is summed over the layers and
returned without its coefficient (the engine weighs it: `loss.moe_loss_coeff`). The counts are the router's top-k
choices (picked with the bias, as the experts compute them); no gradient flows through them.

- `global_batch` (XTuner's `BalancingLossConfig(balancing_loss_global_average=True)`): per layer,
  E / (T_g k) * sum_e c_e * P_e, where c_e counts layer l's choices of expert e over the tokens of every rank's
  micro-batch (T_g tokens; the counts all-reduced without gradient) and P_e = (1 / T_g) sum_t w_{t,e} is the mean of
  XTuner's router weights w (the biased scores the choice is made on, 0 outside the kept groups, normalised to sum 1
  per token; `BiasRouter.choice_shares`) over the same tokens, their sum all-reduced with autograd (each rank's
  gradient is then the one of the global loss, which the data-parallel average keeps). 1 for a balanced router.
  A softmax router's weights are its softmax over all E experts (XTuner's `GreedyRouter`'s `router_weights`).
- `micro_batch` (XTuner's `balancing_loss_global_average=False`): the same over this rank's micro-batch alone.
- `sequence` (DeepSeek-V3 report, eq. 17-20, the complementary sequence-wise balance loss): per layer and sequence
  (a row of the micro-batch) of S tokens, sum_e f_e * P_e with f_e = E / (k S) * (choices of e in the row) and
  P_e = (1 / S) sum_t s'_{t,e}, s' the sigmoid scores normalised over all E experts (no bias); averaged over the
  rows. 1 for a balanced router.
- `transformers` (transformers' `load_balancing_loss_func`, the Switch Transformer's loss as Mixtral, Qwen-MoE and
  GPT-OSS add it): E * sum_e (c_e / N) * (p_e / N), c_e the top-k choices of e and p_e the sum of softmax(logits)_e,
  both pooled over every sparse block and token of the forward (N = blocks x tokens) before the product: one number
  for the whole stack, not a sum over blocks (about k for a balanced router).
"""

from typing import Any

import torch

from internlm_offload.model.hooks import RouterStatsPoolFn
from internlm_offload.model.output import MOE_AUX
from internlm_offload.model.router import RouterStats, global_aux_loss

BALANCING_LOSSES = ("global_batch", "micro_batch", "sequence", "transformers")
TRANSFORMERS = "transformers"


def balancing_loss(
    kind: str, stats: list[RouterStats], num_experts: int, top_k: int, pool: RouterStatsPoolFn | None = None
) -> torch.Tensor:
    """The `kind` loss (one of BALANCING_LOSSES) of one forward's bias routers, summed over the layers; `pool` sums
    the global batch's statistics over the ranks (model/hooks.py `PoolsRouterStats`; None: this process's
    micro-batch is the whole batch)."""
    if kind == "sequence":
        return sequence_balance_loss(stats, num_experts, top_k)
    if kind == TRANSFORMERS:
        return global_aux_loss(stats, num_experts)
    counts, shares = choice_statistics(stats)
    tokens = torch.tensor([float(s.tokens) for s in stats], device=counts.device)
    if kind == "global_batch" and pool is not None:
        counts, shares = pool(counts, shares)
        tokens = counts.sum(-1) / top_k  # every rank's tokens (XTuner: the pooled counts over k)
    elif kind not in BALANCING_LOSSES:
        raise ValueError(f"balancing loss {kind!r}: one of {BALANCING_LOSSES}")
    return xtuner_balance_loss(counts, shares, tokens, num_experts, top_k)


def training_aux_losses(
    kind: str | None,
    stats: list[RouterStats],
    num_experts: int,
    top_k: int,
    pool: RouterStatsPoolFn | None,
    training: bool,
) -> dict[str, torch.Tensor]:
    """A family's `aux_losses`: `moe_aux`, the `kind` balancing loss of a training forward's routers, unweighted;
    none without a kind, without routers, or in a validation forward (its losses are not training's)."""
    if kind is None or not training or not stats:
        return {}
    return {MOE_AUX: balancing_loss(kind, stats, num_experts, top_k, pool)}


def choice_statistics(stats: list[RouterStats]) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, E) top-k choices per expert (no gradient) and (L, E) sums over the tokens of XTuner's router weights: the
    bias router's `choice_shares`, a softmax router's softmax over all experts (`prob_sum`)."""
    shares = [s.prob_sum if s.choice_shares is None else s.choice_shares().sum(0) for s in stats]
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


# ----------------------------------------------------------------------------- a transformers folder's own loss


def folder_coefficient(hf_config: Any) -> float | None:
    """The weight of transformers' balancing loss a (text) config trains with: its `router_aux_loss_coef` where it
    asks for router logits (`output_router_logits`: transformers' causal LM then adds that loss to its training loss),
    else None (none added, as transformers adds none; a coefficient of 0 adds nothing either)."""
    if not getattr(hf_config, "output_router_logits", False):
        return None
    return float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0) or None


def chosen_loss(section_kind: str | None, folder_weight: float | None) -> str | None:
    """The balancing loss of a model built from a transformers config: `model.balancing_loss` where set, else
    transformers' own where the config trains with it (`folder_coefficient`), else none."""
    if section_kind is not None:
        return section_kind
    return TRANSFORMERS if folder_weight is not None else None


def loss_coefficients(section_kind: str | None, moe_loss_coeff: float, folder_weight: float | None) -> dict[str, float]:
    """`moe_aux`'s weight: `loss.moe_loss_coeff` for the loss `model.balancing_loss` names, the config's
    `router_aux_loss_coef` for transformers' own (`chosen_loss`); none without a loss."""
    if section_kind is not None:
        return {MOE_AUX: moe_loss_coeff}
    return {} if folder_weight is None else {MOE_AUX: folder_weight}


def folder_loss_problem(section_kind: str | None, folder_weight: float | None, pipeline_size: int) -> str | None:
    """What is wrong with transformers' own loss of a config (`chosen_loss`) in the run, one line; None if nothing:
    it pools every sparse block's statistics before its product, so it does not split over pipeline stages
    (`model.balancing_loss` is refused there by config/pipeline.py)."""
    if section_kind is not None or folder_weight is None or pipeline_size == 1:
        return None
    return (
        f"parallel.pipeline.size={pipeline_size} with config.json's output_router_logits=True (router_aux_loss_coef="
        f"{folder_weight:g}): transformers' balancing loss pools every sparse block before its product and is not "
        "split over stages; set output_router_logits=false in config.json (or model.hf_config), or pipeline size 1"
    )
