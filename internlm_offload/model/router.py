"""The MoE router: fp32 scores, top-k choice, GShard's capacity, and the load-balancing losses.

Notation: T tokens, E experts, k choices per token. Formulas follow InternEvo (develop, 2025) and transformers
5.24; docs in /work/shared/reference/moe.md §3, §4, §7.
"""

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from internlm_offload.config.moe import group_problem
from internlm_offload.model.mlp import ParamInit, normal_init

SCORING_FUNCS = ("softmax", "sigmoid")
BIAS = "e_score_correction_bias"  # the noaux_tc router's bias, transformers' name (so in state dicts)


@dataclass
class Routing:
    """One layer's routing of T tokens: which k experts each token goes to and with what weight."""

    logits: torch.Tensor  # (T, E) fp32
    scores: torch.Tensor  # (T, E) fp32: softmax or sigmoid of the logits
    indices: torch.Tensor  # (T, k) int64, best first
    weights: torch.Tensor  # (T, k) fp32; 0 where GShard dropped the choice
    kept: torch.Tensor | None = None  # (T, k) bool; None: every choice is computed (Dropless)


@dataclass
class RouterStats:
    """What a layer's load-balancing loss is made of; the global (Qwen) loss pools them over layers."""

    tokens: int  # T
    top1_counts: torch.Tensor  # (E,) fp32: tokens whose best expert is e (GShard's f_e * T)
    topk_counts: torch.Tensor  # (E,) fp32: choices of e among all T*k (before any capacity drop)
    score_sum: torch.Tensor  # (E,) fp32, differentiable: sum over tokens of the router's scores
    prob_sum: torch.Tensor  # (E,) fp32, differentiable: sum over tokens of softmax(logits)
    # The bias router's forward, read by DeepSeek-V3's balancing losses after the model's forward (model/balancing.py;
    # nothing is computed for them unless asked); None for the other routers
    routing: Routing | None = None
    rows: int = 1  # the T tokens are `rows` sequences of T / rows (the micro-batch's rows)
    # (T, E) fp32, differentiable, computed when called: XTuner's router weights (`BiasRouter.choice_shares`)
    choice_shares: Callable[[], torch.Tensor] | None = None


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) fp32 count of each expert id in `indices`; ids >= E (dropped choices, written as E) are not counted.

    No host sync: the output size is fixed (bincount would sync on an accelerator to find it). cpu: `histc` on
    floats (it rejects integers on cpu; exact below 2**24). Elsewhere `scatter_add_`, which torch makes
    deterministic under `use_deterministic_algorithms` (histc on cuda raises there instead).
    """
    values = indices.reshape(-1)
    if values.device.type != "cpu":
        return scatter_counts(values, num_experts)
    return torch.histc(values.float(), bins=num_experts + 1, min=0, max=num_experts + 1)[:num_experts]


def scatter_counts(values: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`expert_counts` of flat int64 ids in [0, E] by `scatter_add_` (any device)."""
    ones = torch.ones_like(values, dtype=torch.float32)
    return torch.zeros(num_experts + 1, device=values.device).scatter_add_(0, values, ones)[:num_experts]


class Router(nn.Module):
    """Linear gate (E, H), scored in fp32; top-k, optional renormalisation and scaling.

    `bias`: a learned (E,) bias on the logits (GPT-OSS's `router.bias`, a parameter). `softmax_over_topk`: the top-k
    of the raw logits, then a softmax over those k (GPT-OSS; the same choice and weights as a softmax over all E,
    top-k and renormalise, without the division's rounding); `scores` stay the softmax over all E (the statistics).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        scoring_func: str = "softmax",
        normalize_weights: bool = True,
        scaling_factor: float = 1.0,
        *,
        bias: bool = False,
        softmax_over_topk: bool = False,
    ) -> None:
        super().__init__()
        if softmax_over_topk and scoring_func != "softmax":
            raise ValueError(f"softmax_over_topk scores by softmax; got scoring_func={scoring_func!r}")
        if scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func={scoring_func!r} must be one of {SCORING_FUNCS}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.scoring_func = scoring_func
        self.normalize_weights = normalize_weights
        self.scaling_factor = scaling_factor
        self.softmax_over_topk = softmax_over_topk
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> Routing:
        """Route x (T, H)."""
        # fp32 whatever the compute dtype: bf16 logits tie and reorder the top-k of nearby experts
        bias = None if self.bias is None else self.bias.float()
        logits = F.linear(x.float(), self.weight.float(), bias)  # (T, E)
        scores = logits.softmax(-1) if self.scoring_func == "softmax" else logits.sigmoid()
        if self.softmax_over_topk:
            top, indices = logits.topk(self.top_k, dim=-1)  # (T, k) raw logits, best first
            return Routing(logits, scores, indices, top.softmax(-1) * self.scaling_factor)
        weights, indices = scores.topk(self.top_k, dim=-1)  # (T, k), sorted best first
        if self.normalize_weights:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.scaling_factor != 1.0:
            weights = weights * self.scaling_factor
        return Routing(logits, scores, indices, weights)

    def stats(self, routing: Routing, rows: int = 1) -> RouterStats:
        """The counts and score sums the load-balancing losses need (counts before any capacity drop); the T tokens
        are `rows` sequences of T / rows (the bias router's per-sequence sums read them)."""
        E = self.num_experts
        probs = routing.scores if self.scoring_func == "softmax" else routing.logits.softmax(-1)
        return RouterStats(
            tokens=routing.logits.shape[0],
            top1_counts=expert_counts(routing.indices[:, 0], E),
            topk_counts=expert_counts(routing.indices, E),
            score_sum=routing.scores.sum(0),
            prob_sum=probs.sum(0),
        )

    def param_inits(self, std: float) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        """normal(0, std) for the weight and a bias (transformers draws GPT-OSS's router bias so)."""
        yield self.weight, normal_init(std)
        if self.bias is not None:
            yield self.bias, normal_init(std)


class BiasRouter(Router):
    """DeepSeek-V3's noaux_tc router (transformers' `DeepseekV3TopkRouter`, XTuner's `NoAuxRouter`): sigmoid scores
    plus a per-expert `e_score_correction_bias` choose the top-k, among the experts of the `topk_group` best of
    `n_group` equal groups; the weights are the unbiased scores of the chosen, renormalised over the k
    (`normalize_weights`), then always times `scaling_factor`. The statistics are the sigmoid router's.

    The bias is a persistent fp32 buffer (state dicts, checkpoints), zero at the start, outside autograd and the
    optimizer: only the once-a-step update moves it (engine/router_bias.py), from the choices its sparse block
    counts (`MoE.take_choices`).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        normalize_weights: bool = True,
        scaling_factor: float = 1.0,
        n_group: int = 1,
        topk_group: int = 1,
    ) -> None:
        super().__init__(hidden_size, num_experts, top_k, "sigmoid", normalize_weights, scaling_factor)
        problem = group_problem(num_experts, top_k, n_group, topk_group)
        if problem:
            raise ValueError(problem)
        self.n_group = n_group
        self.topk_group = topk_group
        self.register_buffer(BIAS, torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> Routing:
        """Route x (T, H)."""
        logits = F.linear(x.float(), self.weight.float())  # (T, E)
        scores = logits.sigmoid()
        # the bias picks the experts and never weighs them; the choice takes no gradient
        choice = scores.detach() + self.e_score_correction_bias
        if self.topk_group < self.n_group:  # all groups kept: nothing masked, the same bits without the step
            choice = group_limited(choice, self.n_group, self.topk_group)
        indices = choice.topk(self.top_k, dim=-1).indices  # (T, k), best (biased) first
        weights = scores.gather(1, indices)
        if self.normalize_weights:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)  # transformers' epsilon
        return Routing(logits, scores, indices, weights * self.scaling_factor)

    def stats(self, routing: Routing, rows: int = 1) -> RouterStats:
        """The sigmoid router's statistics, with the routing itself for DeepSeek-V3's balancing losses (which compute
        what they read only when a loss asks: nothing is held beyond what backward keeps anyway)."""
        stats = super().stats(routing, rows)
        stats.routing, stats.rows = routing, rows
        stats.choice_shares = functools.partial(self.choice_shares, routing.scores)
        return stats

    def choice_shares(self, scores: torch.Tensor) -> torch.Tensor:
        """(T, E) XTuner's router weights of sigmoid scores (T, E): the biased scores the top-k is taken over, 0
        outside the kept groups (XTuner masks with 0), normalised to sum 1 per token; the gradient reaches the scores
        (the bias is a constant)."""
        biased = scores + self.e_score_correction_bias
        if self.topk_group < self.n_group:
            dropped = torch.isneginf(group_limited(biased.detach(), self.n_group, self.topk_group))
            biased = biased.masked_fill(dropped, 0.0)
        return biased / biased.sum(-1, keepdim=True)


def group_limited(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3's node-limited choice: the (T, E) scores with every expert outside the `topk_group` best of
    `n_group` equal groups set to -inf, a group scoring the sum of its 2 best (transformers'; XTuner's 0.0 instead of
    -inf can pick a masked expert once biased scores go negative)."""
    T, E = choice.shape
    grouped = choice.view(T, n_group, E // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (T, n_group)
    kept = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)


# ----------------------------------------------------------------------------- GShard capacity


def gshard_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float, min_capacity: int) -> int:
    """InternEvo's GShard capacity per expert: max(ceil(T / E * capacity_factor * k), min_capacity).

    T is this rank's token count, a Python int from the shape: no host sync.
    """
    return max(math.ceil(tokens / num_experts * capacity_factor * top_k), min_capacity)


def capacity_keep(indices: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """(T, k) bool: which choices fit their expert's `capacity`, filled choice-major as InternEvo's fused GShard
    gating does: every token's 1st choice before any 2nd choice, earlier tokens before later ones."""
    T, k = indices.shape
    flat = indices.t().reshape(-1)  # (k*T,) choice-major
    order = torch.argsort(flat, stable=True)  # grouped by expert, arrival order kept within a group
    counts = expert_counts(flat, num_experts).long()
    starts = counts.cumsum(0) - counts  # first slot of each expert's group in `order`
    rank_sorted = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)  # arrival rank within the expert
    return (rank < capacity).view(k, T).t()


def drop_over_capacity(routing: Routing, capacity: int) -> Routing:
    """GShard: zero the choices over capacity and renormalise the survivors to sum to 1 per token (a token with
    none left gets 0: only the residual carries it), with InternEvo's eps clamp of the denominator."""
    kept = capacity_keep(routing.indices, routing.scores.shape[-1], capacity)
    weights = routing.weights * kept
    denom = weights.sum(-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)
    return Routing(routing.logits, routing.scores, routing.indices, weights / denom, kept)


# ----------------------------------------------------------------------------- load-balancing losses


def gshard_aux_loss(stats: RouterStats, num_experts: int) -> torch.Tensor:
    """InternEvo GShard: E * sum_e f_e * P_e, f_e the share of tokens whose top-1 is e, P_e the mean score.
    A uniform router gives 1."""
    T = stats.tokens
    return num_experts * torch.sum((stats.top1_counts / T) * (stats.score_sum / T))


def dropless_aux_loss(stats: RouterStats, num_experts: int, top_k: int) -> torch.Tensor:
    """InternEvo Dropless per layer: E / (T k) * sum_e count_e * mean_t score_{t,e}. A uniform router gives 1."""
    T = stats.tokens
    return num_experts / (T * top_k) * torch.sum(stats.topk_counts * (stats.score_sum / T))


def global_aux_loss(all_stats: list[RouterStats], num_experts: int) -> torch.Tensor:
    """transformers' (and InternEvo Qwen's) loss: E * sum_e (pooled top-k counts / rows) * (pooled softmax
    sums / rows), statistics pooled over all layers before the product. A uniform router gives about k."""
    rows = sum(s.tokens for s in all_stats)
    counts = torch.stack([s.topk_counts for s in all_stats]).sum(0)
    probs = torch.stack([s.prob_sum for s in all_stats]).sum(0)
    return num_experts * torch.sum((counts / rows) * (probs / rows))


def router_logits_stats(logits: torch.Tensor, top_k: int) -> RouterStats:
    """`RouterStats` of a softmax top-k router from its (T, E) logits alone, as transformers' load-balancing loss reads
    them: the choices are the top-k of softmax(logits) in the logits' dtype, the sums in fp32."""
    probs = logits.softmax(-1)
    indices = probs.topk(top_k, dim=-1).indices
    E = logits.shape[-1]
    prob_sum = probs.float().sum(0)
    return RouterStats(
        tokens=logits.shape[0],
        top1_counts=expert_counts(indices[:, 0], E),
        topk_counts=expert_counts(indices, E),
        score_sum=prob_sum,
        prob_sum=prob_sum,
    )


# ----------------------------------------------------------------------------- the noaux_tc router bias


class ChoiceCounts:
    """Top-k choices per expert of `num_routers` routers, summed over the forwards since the last `take` (device
    tensors, no host sync): a step's load, which the router bias update reads once per step."""

    def __init__(self, num_routers: int) -> None:
        self.num_routers = num_routers
        self._counts: list[torch.Tensor | None] = [None] * num_routers

    def add(self, router: int, indices: torch.Tensor, num_experts: int) -> None:
        """Count router `router`'s choices `indices` (T, k) of one forward."""
        counts = expert_counts(indices.detach(), num_experts)
        previous = self._counts[router]
        self._counts[router] = counts if previous is None else previous + counts

    def take(self) -> torch.Tensor | None:
        """(routers, E) fp32 counts since the last call, and reset; None when no forward counted (a router skipped
        counts zero)."""
        counts, self._counts = self._counts, [None] * self.num_routers
        return stack_counts(counts)


class StepChoices(Protocol):
    """What the bias update reads once a step: `ChoiceCounts` (transformers' routers), `moe.BiasBlocks` (native)."""

    def take(self) -> torch.Tensor | None:
        """(routers, E) fp32 top-k choices per expert since the last call, and reset; None when nothing counted."""
        ...


def stack_counts(counts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """(routers, E) of per-router (E,) counts, a router that counted nothing (None) as zeros; None if none counted."""
    counted = [c for c in counts if c is not None]
    if not counted:
        return None
    zeros = torch.zeros_like(counted[0])
    return torch.stack([zeros if c is None else c for c in counts])


def bias_update(bias: torch.Tensor, counts: torch.Tensor, speed: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing (XTuner's `update_bias`): the bias of an expert chosen more often
    than the mean of its router's experts goes down by `speed`, of one chosen less often up by `speed`, of one
    chosen exactly the mean number of times stays. bias, counts: (..., E), one row per router; fp32 in, fp32 out."""
    excess = counts - counts.mean(-1, keepdim=True)
    return bias - speed * torch.sign(excess)


def max_violation(counts: torch.Tensor) -> torch.Tensor:
    """XTuner's `maxvio`: over routers (rows of `counts`, (routers, E)), the mean of (busiest expert's count - mean
    count) / mean count; 0 for a perfectly balanced step."""
    mean = counts.mean(-1)
    return ((counts.amax(-1) - mean) / mean.clamp(min=1e-9)).mean()
