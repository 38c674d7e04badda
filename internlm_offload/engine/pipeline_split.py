"""A decoder cut into pipeline stages: InternEvo's uniform partition, the stage-to-rank placement, and the
stage module (a run of blocks, the embedding on the first stage, norm and head on the last).

The partition and the placement are config/pipeline_partition.py's. A stage with sparse blocks records their
routing as the whole model's forward does (the load-balancing statistics, the tokens per expert, a bias router's
choices) in the schedule's forwards of micro-batches alone (`record_routing`): torch's first-step shape inference
runs the stage once more, on the first stage's real tokens and elsewhere on uninitialised buffers.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.nn as nn

from internlm_offload.config.pipeline_partition import local_stages, partition_uniform
from internlm_offload.engine.stage_aux_loss import StageAuxLosses
from internlm_offload.model.attention import Documents
from internlm_offload.model.decoder import Decoder, Rope, router_stats, sparse_blocks
from internlm_offload.model.hooks import ShardsSequence
from internlm_offload.model.rope import float32_inv_freq, rope_cos_sin


class PipelineChunk(nn.Module, ShardsSequence):
    """Blocks `[start, end)` of a decoder (model/decoder.py); the first stage embeds the token ids, the last returns logits.

    Holds the decoder's own modules (no copy): a stage built from the seed-built whole model starts from the
    one-process weights. Block names keep their global index (`layers.5`), as in the whole model.

    Under a tensor mode that splits the sequence (msp, fsp, isp over T ranks: `sequence_parts` = T) the hidden
    states a stage takes and returns are this tensor rank's 1/T of the sequence, plain tensors (the modes' plans
    take and return local shards between blocks); RoPE is then that of the whole sequence. Under isp
    (`sequence_shard`, set by the builder: model/hooks.py) the first stage keeps its chunk of the token ids and every
    stage its chunk of the positions.
    """

    def __init__(
        self,
        model: Decoder,
        start: int,
        end: int,
        *,
        first: bool,
        last: bool,
        aux_coefficients: Mapping[str, float] = MappingProxyType({}),
    ) -> None:
        """`aux_coefficients`: the weight of each auxiliary loss the model returns, by name (the trainer's)."""
        super().__init__()
        self.first, self.last = first, last
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(start, end)})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        # what Decoder.rope_cos_sin reads, so that every stage computes RoPE as the whole model does
        self.rope_dim, self.rope_base = model.rope_dim, model.rope_base
        self.inv_freq_fn, self.rope_attention_factor = model.inv_freq_fn, model.rope_attention_factor
        self.register_buffer("inv_freq", model.inv_freq, persistent=False)
        self.sequence_parts = 1  # msp / fsp / isp over T ranks: T (set by the builder)
        # this stage's sparse blocks' losses, backpropagated here (engine/stage_aux_loss.py)
        self.aux_losses = StageAuxLosses(model.stage_aux_losses(), aux_coefficients)
        self.record_routing = False  # set by the stage around each micro-batch's forward (engine/pipeline.py)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) on the first stage, hidden states (B, T, C) on the others (B, T / parts, C under a
        mode that splits the sequence); logits on the last."""
        seq_len = x.shape[1] if self.first else x.shape[1] * self.sequence_parts  # the whole sequence's
        documents = None if position_ids is None else Documents(position_ids)  # the whole sequence's
        shard = self.sequence_shard
        if shard is not None:  # isp: this rank's chunk of the positions (and of the tokens on the first stage)
            if position_ids is None:
                position_ids = torch.arange(seq_len, device=x.device)[None]
            position_ids = shard.local(position_ids)
            if self.first:
                x, seq_len = shard.local(x), seq_len // shard.size
        h = self.tok_embeddings(x) if self.first else x
        inv_freq = float32_inv_freq(self.inv_freq, self.rope_dim, self.rope_base, self.inv_freq_fn)
        rope = rope_cos_sin(inv_freq, seq_len, h.dtype, position_ids, self.rope_attention_factor)
        h = self._blocks(h, rope, documents)
        # Multi-token prediction, when a stage runs it, belongs here on the last stage: its block takes the
        # pre-norm `h` and its loss goes through the same head (config/pipeline.py refuses it for now).
        return self.output(self.norm(h)) if self.last else h

    def _blocks(self, h: torch.Tensor, rope: Rope, documents: Documents | None) -> torch.Tensor:
        """The stage's blocks; in a micro-batch's forward their routing recorded and the auxiliary losses carried."""
        moes = sparse_blocks(self.layers.values()) if self.record_routing else []
        if not moes:
            for layer in self.layers.values():
                h = layer(h, rope, documents)
            return h
        with router_stats(moes) as stats:
            for layer in self.layers.values():
                h = layer(h, rope, documents)
        return self.aux_losses.attach(h, stats)


def split_model(
    model: Decoder,
    size: int,
    num_chunks: int,
    rank: int,
    v_shape: bool,
    aux_coefficients: Mapping[str, float] = MappingProxyType({}),
) -> dict[int, PipelineChunk]:
    """This pipeline rank's stages of `model`, by stage index; the blocks of other ranks' stages are dropped.
    `aux_coefficients`: the weight of each auxiliary loss the model returns (each stage carries its share)."""
    ranges = partition_uniform(model.num_layers, size, num_chunks)
    last = len(ranges) - 1
    return {
        s: PipelineChunk(model, *ranges[s], first=s == 0, last=s == last, aux_coefficients=aux_coefficients)
        for s in local_stages(rank, size, num_chunks, v_shape)
    }


def stage_blocks(chunks: dict[int, PipelineChunk]) -> nn.ModuleList:
    """The decoder blocks of this rank's stages, in stage order (what the layer plan acts on)."""
    return nn.ModuleList(block for chunk in chunks.values() for block in chunk.layers.values())
