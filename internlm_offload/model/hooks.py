"""The hooks a model's modules offer the engine: one mixin per hook, which a module's class declares by subclassing.

- `HasTensorPlan` (the model: `InternLM2`): its modules by parallel role (model/tensor_plan.py). Read by
  engine/tensor_parallel.py (the styles), engine/sequence_parallel.py (each block's attention) and
  engine/expert_parallel.py (the sparse blocks).
- `ShardsSequence` (the model, a pipeline stage: `InternLM2`, engine/pipeline_split.py `PipelineChunk`): isp, keep
  this rank's chunk of the tokens and positions. Set by engine/sequence_parallel.py (the model) and
  builder/pipeline.py (the stages).
- `ExchangesSequence` (each block's attention: `Attention`): isp, Ulysses' all-to-all between sequence and heads
  around attention. Set by engine/sequence_parallel.py.
- `SplitsHeadGroups` (a mixer: `GatedDeltaNet`): tensor parallel, its rank's whole head groups. Set by
  engine/tensor_parallel.py.
- `DispatchesExperts` (a sparse block: `MoE`): expert parallel, its `experts` sharded over "ep" and its routed rows
  sent through the dispatch. Set by engine/expert_parallel.py; tensor parallel keeps the block whole, FSDP2 and DDP
  reduce its experts' gradients apart (engine/parallel.py).
- `RecordsRouterStats` (a sparse block: `MoE`): the router statistics of the model's own forward, for the
  load-balancing loss. Set by the model itself, a pipeline stage by its own forward (model/decoder.py `router_stats`).
- `PoolsRouterStats` (the model: `DeepseekV3`): its global-batch balancing loss sums its router statistics over the
  ranks. Set by the builder (builder/model.py, engine/router_pool.py `RouterStatsPool`) on a distributed run.
- `KeepsFp32Buffers` (a sparse block with a bias router: `MoE`; the transformers wrapper: `HFCausalLM`): buffers
  that stay fp32 whatever the compute dtype (a router bias). Read by engine/precision.py's casts.
- `SplitsMuonRows` (a module whose weight fuses row blocks: MLA's `MultiLatentAttention`): the row blocks Muon
  orthogonalises apart (XTuner's MuonSplit). Read by builder/optimizer.py into the param groups (`row_splits`).
- `Hostable` (offload/hosted_base.py, a floor below; frozen modules that say how to be held on the host:
  `GroupedExperts`, `Linear4bit`): `model.lora.base_on_host`, their tensors in host memory, brought in a block at
  a time. Its `hosted` slot is set by offload/hosted_base.py `HostedBase`.

Why nominal mixins and not `runtime_checkable` Protocols: `isinstance` against a runtime-checkable Protocol only
checks that the attribute names exist, which is the `hasattr` test these hooks replace: a module that happens to
have an attribute of that name would pass, and one that forgot it is indistinguishable from one that never meant
to. A mixin is a declaration the class makes ("my forward uses the exchange"), `isinstance` asks exactly that, and
the mixin carries the slot's type and default (None: the feature is off), so a new family gets a working default
by declaring the hook. The engine finds the modules through the model's plan and refuses in one line a feature
asked of a module that does not declare its hook (engine/model_plan.py), never skipping it silently.

What the hooks are handed is typed by Protocols (`SequenceChunk`, `SequenceExchange`, `ExpertDispatchFn`): the
engine's classes satisfy them structurally, so the model names no engine class (a higher layer).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from internlm_offload.model.router import RouterStats
from internlm_offload.model.tensor_plan import TensorPlan
from internlm_offload.offload.hosted_base import Hostable

__all__ = [
    "DispatchesExperts",
    "ExchangesSequence",
    "ExpertDispatchFn",
    "ExpertSplitFn",
    "HasTensorPlan",
    "HeadGroupSplit",
    "Hostable",
    "KeepsFp32Buffers",
    "PoolsRouterStats",
    "RecordsRouterStats",
    "RouterStatsPoolFn",
    "SequenceChunk",
    "SequenceExchange",
    "ShardsSequence",
    "SplitsHeadGroups",
]


class SequenceChunk(Protocol):
    """What a model reads of its isp shard (engine/sequence_parallel.py `SequenceShard`)."""

    size: int

    def local(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous chunk of `tensor` along `dim`."""
        ...


class SequenceExchange(Protocol):
    """isp's all-to-all (engine/sequence_parallel.py `SequenceAllToAll` over the tensor group): this rank's place in
    the group (`rank` of `size`), whose heads' whole sequences it receives."""

    rank: int
    size: int

    def __call__(self, x: torch.Tensor, *, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """Split `x` along `scatter_dim` over the ranks, gather what they send along `gather_dim`."""
        ...

    def own_heads(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's contiguous chunk of `x` along a query-heads dim: the heads the exchange hands this rank (a
        per-head parameter of a whole attention, GPT-OSS's sinks, goes with its heads)."""
        ...


class ExpertDispatchFn(Protocol):
    """Expert parallel's dispatch (engine/expert_parallel.py `ExpertDispatch`)."""

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """The experts' outputs for `rows` sorted by global expert, `counts[e]` rows each, computed where they live."""
        ...


class ExpertSplitFn(Protocol):
    """The experts split over the tensor group (engine/expert_tensor_parallel.py `PartialReaders`)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (whole on every tensor rank) as it is, for reads that make this rank's part of a summed output: in
        backward their gradient, each rank's part, is summed over the tensor group."""
        ...


class RouterStatsPoolFn(Protocol):
    """The global batch's router statistics (engine/router_pool.py `RouterStatsPool`)."""

    def __call__(self, counts: torch.Tensor, sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts, sums) summed over the ranks: the counts without gradient, the sums with (the backward sums the
        gradients over the same ranks)."""
        ...


class HasTensorPlan:
    """A model whose modules the parallel features find by role (model/tensor_plan.py)."""

    def tensor_plan(self) -> TensorPlan:
        """This model's plan: the model-level modules and one `BlockPlan` per entry of `layers`."""
        raise NotImplementedError(f"{type(self).__name__} declares HasTensorPlan but gives no tensor_plan()")


class ShardsSequence:
    """A model (or pipeline stage) that takes the whole micro-batch and, with a shard, keeps its rank's chunk of the
    tokens and positions (isp); documents' boundaries still come from the whole sequence's positions."""

    sequence_shard: SequenceChunk | None = None


class ExchangesSequence:
    """An attention module that, with an exchange, trades its local (B, s/T, H, D) queries, keys and values for the
    whole sequence of H/T heads before attending, and the output back after (isp's Ulysses attention)."""

    sequence_exchange: SequenceExchange | None = None


class HeadGroupSplit(Protocol):
    """Which whole head groups a tensor rank holds: the `rank`-th of `size` equal runs (engine/tensor_parallel.py)."""

    rank: int
    size: int

    def local_input(self, x: torch.Tensor) -> torch.Tensor:
        """The mixer's input as this rank's plain tensor, for a projection it computes from a whole weight's rows:
        its gradient (this rank's heads' part) summed over the tensor group in backward."""
        ...


class SplitsHeadGroups:
    """A mixer whose column projections tensor parallel splits by whole head groups, its other per-head parameters
    (a conv's channels, per-head decay rates) whole on every rank: with a split it computes the groups of its rank
    (Gated DeltaNet's key-head groups). Set by engine/tensor_parallel.py (`WholeParameters`)."""

    head_groups: HeadGroupSplit | None = None


class DispatchesExperts:
    """A sparse block whose routed experts the engine may shard over ranks: `experts` holds only parameters stacked
    over the `num_experts` experts on dim 0, and with a dispatch the block sends its sorted rows through it instead
    of computing them all here."""

    experts: nn.Module
    num_experts: int
    expert_dispatch: ExpertDispatchFn | None = None
    # the experts split over the tensor group (each rank a slice of every expert, its output a partial sum): what
    # the block reads into that partial output passes through it; None: nothing split
    expert_split: ExpertSplitFn | None = None


class RecordsRouterStats:
    """A sparse block that appends its router statistics to a sink while the model lends it one.

    The model lends each sparse block a list during its own forward and takes it back after: a forward recomputed
    in backward (activation checkpointing) finds none and keeps nothing. Statistics stored on the module would hold
    the recomputed graph, block activations included, until the next step.
    """

    stats_sink: list[RouterStats] | None = None


class PoolsRouterStats:
    """A model whose global-batch balancing loss sums its (layers, E) router counts and weight sums over the ranks
    with the pool it is lent; None: this process's micro-batch is the whole batch."""

    stats_pool: RouterStatsPoolFn | None = None


class KeepsFp32Buffers:
    """A module some of whose buffers stay fp32 whatever the compute dtype: a cast to bf16 keeps these very tensors
    (engine/precision.py `fp32_buffers_kept`)."""

    def fp32_buffers(self) -> list[tuple[nn.Module, str]]:
        """(module, buffer name) of each kept buffer; none by default."""
        return []


class SplitsMuonRows:
    """A module some of whose weights stack row blocks that are separate matrices to Muon (XTuner's MuonSplit: MLA's
    per-head (nope, rope) queries, (latent, rope) keys, per-head (nope, v) keys and values)."""

    def muon_row_splits(self) -> dict[str, tuple[int, ...]]:
        """Parameter name (relative to this module) -> its row blocks, top to bottom, summing to its rows."""
        return {}
