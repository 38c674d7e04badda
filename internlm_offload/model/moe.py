"""The mixture-of-experts feed-forward on one rank: route, permute by expert, grouped experts, combine.

`moe_type="GShard"` drops the choices over each expert's capacity (InternEvo's fused gating); `"Dropless"`
computes every routed choice, optionally routed by DeepSeek-V3's noaux_tc router (`score_correction_bias`, with
group-limited choice: `n_group`, `topk_group`; model/router.py `BiasRouter`). Shared experts run on every token
beside the routed ones, mixed in by a sigmoid gate (Qwen2-MoE's `shared_expert_gate`), a softmax coefficient over
(routed, shared) (InternEvo's InternLM1 and Mixtral `MoE`) or added as they are (`"none"`: DeepSeek-V3, GLM-4.5).
A forward with a `stats_sink` appends to it what the load-balancing loss needs; with an `expert_dispatch` (expert
parallel) the routed rows go to the ranks holding their experts (model/hooks.py).
"""

from collections.abc import Callable, Iterator

import torch
from torch import nn

from internlm_offload.config.moe import MOE_TYPES
from internlm_offload.model.experts import ClampedSwiGLU, GroupedExperts
from internlm_offload.model.hooks import DispatchesExperts, KeepsFp32Buffers, RecordsRouterStats
from internlm_offload.model.mlp import FeedForward, ParamInit, normal_init
from internlm_offload.model.permutation import PermuteRows, UnpermuteRows
from internlm_offload.model.router import (
    BIAS,
    BiasRouter,
    Router,
    drop_over_capacity,
    expert_counts,
    gshard_capacity,
    stack_counts,
)

SHARED_EXPERT_GATES = ("softmax", "sigmoid", "none")


def _whole(x: torch.Tensor) -> torch.Tensor:
    """Nothing split: x as it is."""
    return x


def permute(x: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token copies grouped by expert: x (T, H), expert_ids (T, k) with E for a dropped choice.

    Returns the (T*k, H) rows sorted by expert (dropped ones last) and the sort order, whose entry i is the
    flat (token * k + choice) index of sorted row i.
    """
    k = expert_ids.shape[1]
    # Stable: within an expert, tokens keep their order, so the result does not depend on the sort kernel.
    order = torch.argsort(expert_ids.reshape(-1), stable=True)
    # Not a plain x[order // k]: its backward would accumulate the k copies of a token with
    # index_put(accumulate=True), not deterministic everywhere; PermuteRows sums them in choice order.
    return PermuteRows.apply(x, order, k), order


def unpermute(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Inverse of `permute`, then the weighted sum over each token's k choices: (T*k, H) -> (T, H)."""
    T, k = weights.shape
    flat = UnpermuteRows.apply(rows, order).view(T, k, -1)  # a permutation both ways: no row is hit twice
    return (flat * weights.to(rows.dtype)[..., None]).sum(1)


class MoE(nn.Module, DispatchesExperts, RecordsRouterStats, KeepsFp32Buffers):
    """Router + stacked experts (+ shared experts): the feed-forward of a sparse decoder block."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        moe_type: str = "GShard",
        num_shared_experts: int = 0,
        shared_expert_gate: str = "softmax",
        capacity_factor: float = 1.0,
        min_capacity: int = 4,
        drop_tokens: bool = True,
        normalize_expert_weights: bool = True,
        scoring_func: str = "softmax",
        routed_scaling_factor: float = 1.0,
        score_correction_bias: bool = False,
        n_group: int = 1,
        topk_group: int = 1,
        router_bias: bool = False,
        softmax_over_topk: bool = False,
        expert_bias: bool = False,
        expert_activation: ClampedSwiGLU | None = None,
        shared_intermediate_size: int | None = None,
    ) -> None:
        """`shared_intermediate_size`: the shared experts' width (Qwen3-Next's `shared_expert_intermediate_size`;
        default `intermediate_size * num_shared_experts`). `router_bias`, `softmax_over_topk` (model/router.py `Router`), `expert_bias` and `expert_activation`
        (model/experts.py `GroupedExperts`) are GPT-OSS's options."""
        super().__init__()
        if moe_type not in MOE_TYPES:
            raise ValueError(f"moe_type={moe_type!r}: supported here: {', '.join(MOE_TYPES)}")
        if shared_expert_gate not in SHARED_EXPERT_GATES:
            raise ValueError(f"shared_expert_gate={shared_expert_gate!r} must be one of {SHARED_EXPERT_GATES}")
        if score_correction_bias and (moe_type != "Dropless" or scoring_func != "sigmoid"):
            raise ValueError(
                f"score_correction_bias: DeepSeek-V3's router scores by sigmoid and computes every choice; got "
                f"moe_type={moe_type!r}, scoring_func={scoring_func!r}"
            )
        if not score_correction_bias and (n_group, topk_group) != (1, 1):
            raise ValueError(f"n_group={n_group}, topk_group={topk_group}: group-limited routing needs the bias router")
        self.num_experts = num_experts
        self.top_k = top_k
        self.moe_type = moe_type
        self.capacity_factor = capacity_factor
        self.min_capacity = min_capacity
        # GShard always renormalises the surviving choices and scores by softmax (InternEvo's fused gating)
        gshard = moe_type == "GShard"
        self.drop_tokens = gshard and drop_tokens
        self.router: Router
        if score_correction_bias:
            self.router = BiasRouter(
                hidden_size,
                num_experts,
                top_k,
                normalize_weights=normalize_expert_weights,
                scaling_factor=routed_scaling_factor,
                n_group=n_group,
                topk_group=topk_group,
            )
        else:
            self.router = Router(
                hidden_size,
                num_experts,
                top_k,
                scoring_func="softmax" if gshard else scoring_func,
                normalize_weights=gshard or normalize_expert_weights,
                scaling_factor=1.0 if gshard else routed_scaling_factor,
                bias=router_bias,
                softmax_over_topk=softmax_over_topk,
            )
        self.experts = GroupedExperts(
            num_experts, hidden_size, intermediate_size, bias=expert_bias, activation=expert_activation
        )
        self.shared_expert_gate = shared_expert_gate
        self.shared_experts: FeedForward | None = None
        self.coefficient: nn.Linear | None = None
        if num_shared_experts > 0:
            shared_width = shared_intermediate_size or intermediate_size * num_shared_experts
            self.shared_experts = FeedForward(hidden_size, shared_width)
            if shared_expert_gate == "sigmoid":  # Qwen2-MoE: sigmoid(Linear(H, 1)) scales the shared output
                self.coefficient = nn.Linear(hidden_size, 1, bias=False)
            elif shared_expert_gate == "softmax":  # InternEvo MoE: softmax(Linear(H, 2)) weighs (routed, shared)
                self.coefficient = nn.Linear(hidden_size, 2)
        # `expert_dispatch` (expert parallel; None: every expert on this rank) and `stats_sink` (lent by the model
        # during its own forward): model/hooks.py
        self.tokens_per_expert: torch.Tensor | None = None  # (E,) after capacity, last forward; detached
        # (E,) fp32 sum of tokens_per_expert over the model's forwards since the last `take_load`: added by the
        # model after its forward (a recompute in backward would count a block's forward twice), on the device
        self.load: torch.Tensor | None = None
        # (E,) fp32 top-k choices of the bias router over the model's training forwards since the last
        # `take_choices`: the load its bias moves against (the same rule as `load`: never a recompute's)
        self.choices: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (T, H)
        routing = self.router(x)
        # computed in a recompute too, then dropped: activation checkpointing wants the tensors the recompute saves
        # to be the forward's (a sigmoid router's stats save a softmax of their own)
        stats = self.router.stats(routing, rows=shape[0] if len(shape) == 3 else 1)
        if self.stats_sink is not None:
            self.stats_sink.append(stats)
        expert_ids = routing.indices
        if self.drop_tokens:
            capacity = gshard_capacity(
                x.shape[0], self.num_experts, self.top_k, self.capacity_factor, self.min_capacity
            )
            routing = drop_over_capacity(routing, capacity)
            expert_ids = torch.where(routing.kept, expert_ids, self.num_experts)  # dropped: sort last
        counts = expert_counts(expert_ids, self.num_experts)
        self.tokens_per_expert = counts.detach()
        # experts split over the tensor group: the output is this rank's part of a sum; what it reads gets its
        # gradient summed (the router reads x whole, its gradient whole on every rank)
        split = self.expert_split or _whole
        read = split(x)  # once: the routed and shared experts' input gradients summed in one reduction
        rows, order = permute(read, expert_ids)
        if self.expert_dispatch is None:
            routed = self.experts(rows, counts, all_routed=not self.drop_tokens)
        else:
            routed = self.expert_dispatch(rows, counts, self.experts)
        out = unpermute(routed, order, split(routing.weights))
        if self.shared_experts is not None:
            out = self._mix_shared(x, read, out, split)
        return out.view(shape)

    @property
    def has_bias_router(self) -> bool:
        return isinstance(self.router, BiasRouter)

    def record_load(self) -> None:
        """Add the last forward's tokens per expert to `load`, and with a bias router in training to `choices` (no
        host sync)."""
        counts = self.tokens_per_expert
        self.load = counts.clone() if self.load is None else self.load + counts
        if self.has_bias_router and self.training:  # a validation forward must not move the bias
            # Dropless (a bias router's only type): the tokens per expert are the top-k choices
            self.choices = counts.clone() if self.choices is None else self.choices + counts

    def take_choices(self) -> torch.Tensor | None:
        """`choices` since the last call, and reset them."""
        choices, self.choices = self.choices, None
        return choices

    def fp32_buffers(self) -> list[tuple[nn.Module, str]]:
        """The bias router's bias: fp32 whatever the compute dtype (it moves by 1e-3 a step; bf16 would round such
        steps away)."""
        return [(self.router, BIAS)] if self.has_bias_router else []

    def take_load(self) -> torch.Tensor | None:
        """`load` since the last call, and reset it."""
        load, self.load = self.load, None
        return load

    def _mix_shared(
        self,
        x: torch.Tensor,
        read: torch.Tensor,
        routed: torch.Tensor,
        split: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """`routed` and the shared experts' output on `read` (`split(x)`) mixed by the gate; with a tensor `split`
        (`forward`'s) both are this rank's parts, so the gate computed from x whole is read through it."""
        shared = self.shared_experts(read)
        if self.shared_expert_gate == "none":
            return routed + shared
        if self.shared_expert_gate == "sigmoid":
            return routed + split(torch.sigmoid(self.coefficient(x))) * shared
        c = split(self.coefficient(x).softmax(-1))
        return routed * c[:, :1] + shared * c[:, 1:]

    def param_inits(self, std: float, out_std: float) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        """Router and expert up-projections normal(0, std), down-projections normal(0, out_std); the softmax
        coefficient's bias zero. A bias router's bias (a buffer) zero too: a meta build's `to_empty` leaves it
        uninitialised, and zeros draw nothing, so the draw order is unchanged."""
        yield from self.router.param_inits(std)
        if self.has_bias_router:
            yield getattr(self.router, BIAS), nn.init.zeros_
        yield from self.experts.param_inits(std, out_std)
        if self.shared_experts is not None:
            yield from self.shared_experts.param_inits(std, out_std)
            if self.coefficient is not None:
                yield self.coefficient.weight, normal_init(std)
                if self.coefficient.bias is not None:
                    yield self.coefficient.bias, nn.init.zeros_


class BiasBlocks:
    """A model's sparse blocks with a bias router, in depth order, as the once-a-step bias update reads them
    (engine/router_bias.py): their biases, and the choices their training forwards counted (`StepChoices`).

    With `held` (a pipeline rank's stages: the part of `model` it keeps) the blocks are those it holds, and the
    choices a table of all `model`'s bias blocks (`rows` of them) with zeros in the rows of the blocks it does not
    hold: summed over every rank, each row then counts the tokens of the ranks that hold its block, and every rank
    joins the sum, whatever it holds. Only the held blocks are kept (the others are freed with the whole model).
    """

    def __init__(self, model: nn.Module, held: nn.Module | None = None) -> None:
        every = [m for m in model.modules() if isinstance(m, MoE) and m.has_bias_router]
        kept = None if held is None else {id(m) for m in held.modules()}
        self.blocks = [m for m in every if kept is None or id(m) in kept]
        # the table rows of `blocks` among every bias block of the model (None: the table is `blocks`' own)
        self.rows: list[int] | None = None if held is None else [i for i, m in enumerate(every) if id(m) in kept]
        self.num_rows = len(every)
        first = getattr(every[0].router, BIAS) if every else None
        self._table = None if first is None else (every[0].num_experts, first.device)

    def biases(self) -> list[torch.Tensor]:
        """Each block's `e_score_correction_bias` (read each time: a load may have replaced the tensors)."""
        return [getattr(block.router, BIAS) for block in self.blocks]

    def take(self) -> torch.Tensor | None:
        """(blocks, E) fp32 choices since the last call, and reset; None when no training forward counted. With
        `held`: the (all bias blocks, E) table, never None."""
        counts = [block.take_choices() for block in self.blocks]
        if self.rows is None:
            return stack_counts(counts)
        num_experts, device = self._table
        table = torch.zeros(self.num_rows, num_experts, device=device)
        for row, count in zip(self.rows, counts, strict=True):
            if count is not None:
                table[row] = count
        return table
