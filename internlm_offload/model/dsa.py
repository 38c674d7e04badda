"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): multi-head latent attention (model/mla.py) where each query
attends only to the `index_topk` earlier keys of its document that a lightning indexer (model/indexer.py) ranks
highest, through the chunked sparse kernel (model/sparse_attention.py).

Cross-layer top-k sharing (GLM-5's `indexer_types`): a "full" layer owns an indexer and hands its choice to the
blocks after it; a "shared" layer has no indexer weights and attends over the choice of the last full layer before
it (`source`). The hand-over goes through the forward's `Documents` (`Documents.shared`, keyed by the source's
index): one object per forward, so a block recomputed in backward (activation checkpointing) reads its own forward's
choice, whatever other micro-batches ran since.

Up to `index_topk` keys per row the choice is every visible key: then the layer is dense MLA (the same kernel, the
same bits); the indexer still runs on a full layer, so that its shared layers find a choice.

The chosen indices are integers: the sparse kernel saves them for backward (activation offload moves them with its
other saved tensors and back, bit for bit); under activation checkpointing the full layer's indexer recomputes them
from the same input (the same integers: same ops, same bits) and the shared layers read the store again.
"""

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from internlm_offload.model.attention import Documents, attend, uses_flash
from internlm_offload.model.indexer import LightningIndexer
from internlm_offload.model.mla import MultiLatentAttention
from internlm_offload.model.mlp import ParamInit
from internlm_offload.model.sparse_attention import sparse_attend

FULL, SHARED = "full", "shared"  # transformers' `indexer_types` values


def indexer_sources(indexer_types: tuple[str, ...]) -> tuple[int, ...]:
    """Each layer's source of top-k: itself where "full", else the last full layer before it; ValueError naming a
    shared layer with none before it, or a value other than FULL / SHARED."""
    sources, last = [], None
    for i, kind in enumerate(indexer_types):
        if kind not in (FULL, SHARED):
            raise ValueError(f"indexer_types[{i}]={kind!r} must be {FULL!r} or {SHARED!r}")
        if kind == FULL:
            last = i
        elif last is None:
            raise ValueError(f"indexer_types[{i}]='shared' has no 'full' layer before it to take the top-k of")
        sources.append(last)
    return tuple(sources)


class SparseLatentAttention(MultiLatentAttention):
    """MLA over the keys an indexer chose: its own (`indexer`, a full layer) or layer `source`'s (a shared one)."""

    def __init__(self, *, layer: int, source: int, indexer: LightningIndexer | None, topk: int, **mla: Any) -> None:
        """`layer` this block's index, `source` the full layer whose choice it uses (itself where it owns `indexer`);
        `topk` the keys per query; `mla` MultiLatentAttention's arguments (q-LoRA required: the indexer reads its
        latent)."""
        super().__init__(**mla)
        if (indexer is None) == (source == layer):
            raise ValueError(f"layer {layer}: an indexer exactly where the layer is its own source (source={source})")
        if self.q_a_proj is None:
            raise ValueError("DeepSeek sparse attention needs q_lora_rank: the indexer reads MLA's query latent")
        self.layer, self.source, self.topk = layer, source, topk
        self.indexer = indexer

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], documents: Documents | None = None
    ) -> torch.Tensor:
        """(B, T, C) -> (B, T, C); `documents` carries the choice between layers (the model always passes one)."""
        if documents is None:
            raise ValueError("DeepSeek sparse attention needs the forward's Documents (position_ids) to share top-k")
        q, k, v, q_latent = self._heads(x, rope)
        exchange = self.sequence_exchange
        if exchange is not None:  # isp: this rank's tokens of all heads -> all tokens of its heads
            q, k, v = (exchange(t, scatter_dim=2, gather_dim=1) for t in (q, k, v))
        chosen = self._choice(x, q_latent, rope, documents)  # (B, T, K) for the whole sequence
        if q.shape[1] <= self.topk:  # every visible key is chosen: dense MLA, bit for bit
            out = attend(q, k, v, documents, flash=uses_flash(self.attn_impl, x), scale=self.scale)
        else:
            out = sparse_attend(q, k, v, chosen, scale=self.scale)
        if exchange is not None:
            out = exchange(out, scatter_dim=1, gather_dim=2)
        return self.o_proj(out.flatten(2))

    def _choice(
        self, x: torch.Tensor, q_latent: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], documents: Documents
    ) -> torch.Tensor:
        """(B, T, K) int32: this layer's indexer's choice (stored for the shared layers after it), or its source's.
        Under isp the indexer's inputs are gathered along the sequence first (no gradient: it is frozen) and every
        rank chooses for the whole sequence, whose every token of its heads it attends after the exchange: the
        indexer's compute repeated on each rank, no collective in backward."""
        if self.indexer is None:
            chosen = documents.shared.get(("dsa_topk", self.source))
            if chosen is None:
                raise RuntimeError(f"layer {self.layer} shares layer {self.source}'s top-k, which did not run")
            return chosen
        if self.sequence_exchange is not None:
            with torch.no_grad():
                x, q_latent = self._gathered(x), self._gathered(q_latent)
                rope = tuple(self._gathered(t if t.dim() == 3 else t[None].expand(x.shape[0], -1, -1)) for t in rope)
        chosen = self.indexer(x, q_latent, rope, documents.position_ids)
        documents.shared[("dsa_topk", self.layer)] = chosen
        return chosen

    def _gathered(self, t: torch.Tensor) -> torch.Tensor:
        """(B, s / P, D) -> (B, s, D): every rank's chunk in rank order, through isp's exchange of one head (which
        repeats a head to every rank: each sends its chunk to all)."""
        return self.sequence_exchange(t[:, :, None], scatter_dim=2, gather_dim=1)[:, :, 0]

    def param_inits(self, std: float, out_std: float) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        """MLA's, then the indexer's (after: MLA's draws are those of a model without DSA)."""
        yield from super().param_inits(std, out_std)
        if self.indexer is not None:
            yield from self.indexer.param_inits(std)
