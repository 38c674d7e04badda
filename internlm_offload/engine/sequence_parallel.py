"""InternEvo's `isp` (Intern sequence parallel): each rank of a tensor group holds 1/T of every sequence.

What it may touch: the model's `sequence_shard` and its attention modules' `sequence_exchange` (set by
`apply_sequence_parallel`; model/hooks.py `ShardsSequence` and `ExchangesSequence`, each block's attention found
through the model's tensor plan); nothing else. Weights stay whole modules: the data-parallel wrapper over all
ranks (DDP, or FSDP2 over the weight group: InternEvo's weight parallel) sums their gradients, which each
rank computes from its part of the sequence.

- The model takes the whole micro-batch and keeps its rank's contiguous chunk of the tokens (and of the
  positions, for RoPE); packed documents' boundaries come from the whole sequence's positions.
- Attention runs Ulysses: the local (B, s/T, H, D) queries, keys and values are exchanged so that each
  rank holds the whole sequence for H/T heads (`all_to_all_single` with autograd, the one collective
  written here), attends, and the output is exchanged back. Where T exceeds the kv heads, each kv head is
  repeated to T before the exchange, as InternEvo does.
- A per-head parameter of the attention (GPT-OSS's sinks) goes with its heads: each rank's attention cuts its
  chunk (`SequenceAllToAll.own_heads`), the wrapper's sum over the ranks then adds each chunk's whole-sequence
  gradient once.
- The loss takes the matching chunk of the labels (shifted before the split) and is weighted by T: the
  wrapper's average over all ranks then sums the chunks of one sequence and averages the data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from internlm_offload.engine.model_plan import sequence_exchangers
from internlm_offload.log import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class SequenceShard:
    """This rank's chunk of every sequence: chunk `rank` of `size` along the sequence dim."""

    rank: int
    size: int
    group: dist.ProcessGroup

    def local(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous chunk of `tensor` along `dim` (the sequence length divides evenly)."""
        return tensor.chunk(self.size, dim=dim)[self.rank]


def sequence_all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` along `scatter_dim` over the group's ranks and concatenate what they send along `gather_dim`
    (rank order), with autograd: the backward is the reverse exchange. (B, s/T, H, D) with scatter 2, gather 1
    becomes (B, s, H/T, D); scatter 1, gather 2 goes back.

    Fewer heads than ranks (grouped-query keys and values, T a multiple of their count): each head is repeated
    T / heads times, consecutively, so rank i gets kv head i // repeats, the group of its H/T query heads; the
    repeats' gradients add up in backward."""
    size = dist.get_world_size(group)
    heads = x.shape[scatter_dim]
    if heads < size:  # only heads can be fewer: a sequence chunk holds at least T tokens
        x = x.repeat_interleave(size // heads, dim=scatter_dim)
    outgoing = x.movedim(scatter_dim, 0).contiguous()  # chunk j of dim 0 goes to rank j
    incoming = all_to_all_single_autograd(outgoing, None, None, group)  # block i of dim 0 came from rank i
    pieces = incoming.movedim(0, scatter_dim).chunk(size, dim=scatter_dim)
    return torch.cat(pieces, dim=gather_dim)


@dataclass(frozen=True)
class SequenceAllToAll:
    """isp's exchange over the tensor group, which an attention calls (model/hooks.py `SequenceExchange`): this rank
    is `rank` of `size` (the head groups it receives, for a mixer with per-head weights: Gated DeltaNet)."""

    group: dist.ProcessGroup
    rank: int
    size: int

    def __call__(self, x: torch.Tensor, *, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        return sequence_all_to_all(x, self.group, scatter_dim, gather_dim)

    def own_heads(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Chunk `rank` of `x` along `dim`: the all-to-all sends query head chunk j to rank j."""
        return x.chunk(self.size, dim=dim)[self.rank]


def apply_sequence_parallel(model: nn.Module, shard: SequenceShard) -> None:
    """isp: the model splits its input, each block's attention exchanges heads for sequence; refused in one line
    where the model or an attention does not take its hook."""
    attentions = sequence_exchangers(model, "parallel.tensor.mode='isp'")
    model.sequence_shard = shard
    exchange = SequenceAllToAll(shard.group, shard.rank, shard.size)
    for attention in attentions:
        attention.sequence_exchange = exchange
    logger.info("Applied tensor parallel isp over %d ranks (sequence chunks, Ulysses attention)", shard.size)
