"""A decoder cut into pipeline stages: InternEvo's uniform partition, the stage-to-rank placement, and the
stage module (a run of blocks, the embedding on the first stage, norm and head on the last).

Multi-token prediction (model/mtp.py) runs on the last stage, after its blocks; its depths read the embeddings of
the ids rolled one, two, ... tokens ahead, which only the first stage can compute: the first stage sends them on
beside the hidden state and every stage passes them through unchanged (their gradients come back the same way into
the one embedding). That is D more (B, T, C) activations between stages, and no copy of the embedding table
(Megatron's choice is the other one: a tied copy on the last stage, its gradient all-reduced with the first's).

The partition and the placement are config/pipeline_partition.py's. A stage with sparse blocks records their
routing as the whole model's forward does (the load-balancing statistics, the tokens per expert, a bias router's
choices) in the schedule's forwards of micro-batches alone (`record_routing`): torch's first-step shape inference
runs the stage once more, on the first stage's real tokens and elsewhere on uninitialised buffers.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import nn

from internlm_offload.config.pipeline_partition import local_stages, partition_uniform
from internlm_offload.engine.stage_aux_loss import StageAuxLosses
from internlm_offload.model.attention import Documents
from internlm_offload.model.decoder import Decoder, Rope, router_stats, sparse_blocks
from internlm_offload.model.hooks import ShardsSequence
from internlm_offload.model.mtp import embedded_inputs
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
        self.mtp = model.mtp if last else None  # multi-token prediction runs on the last stage
        # every stage carries the depths' input embeddings from the first to the last
        self.mtp_depth = 0 if model.mtp is None else model.mtp.settings.depth
        # what Decoder.rope_cos_sin reads, so that every stage computes RoPE as the whole model does
        self.rope_dim, self.rope_base = model.rope_dim, model.rope_base
        self.inv_freq_fn, self.rope_attention_factor = model.inv_freq_fn, model.rope_attention_factor
        self.register_buffer("inv_freq", model.inv_freq, persistent=False)
        self.sequence_parts = 1  # msp / fsp / isp over T ranks: T (set by the builder)
        self.needs_documents = model.needs_documents  # DSA: its blocks hand their top-k on through Documents
        # this stage's sparse blocks' losses, backpropagated here (engine/stage_aux_loss.py)
        self.aux_losses = StageAuxLosses(model.stage_aux_losses(), aux_coefficients)
        self.record_routing = False  # set by the stage around each micro-batch's forward (engine/pipeline.py)

    def forward(
        self, x: torch.Tensor, *carried: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Token ids (B, T) on the first stage, hidden states (B, T, C) on the others (B, T / parts, C under a
        mode that splits the sequence); logits on the last. With multi-token prediction of D depths the stages
        after the first take the D depths' input embeddings after the hidden state (`carried`) and return them
        after theirs; the last returns the logits, then each depth's logits."""
        seq_len = x.shape[1] if self.first else x.shape[1] * self.sequence_parts  # the whole sequence's
        if position_ids is None and self.needs_documents:  # one document per row, as Decoder.forward
            position_ids = torch.arange(seq_len, device=x.device).expand(x.shape[0], seq_len)
        documents = None if position_ids is None else Documents(position_ids)  # the whole sequence's
        whole_ids, whole_positions = x, position_ids  # multi-token prediction rolls them before the split
        shard = self.sequence_shard
        if shard is not None:  # isp: this rank's chunk of the positions (and of the tokens on the first stage)
            if position_ids is None:
                position_ids = torch.arange(seq_len, device=x.device)[None]
            position_ids = shard.local(position_ids)
            if self.first:
                x, seq_len = shard.local(x), seq_len // shard.size
        h = self.tok_embeddings(x) if self.first else x
        if self.first and self.mtp_depth:
            local = shard.local if shard is not None else _whole
            carried = tuple(
                embedded_inputs(whole_ids, whole_positions, self.mtp_depth, embed=self.tok_embeddings, local=local)
            )
        inv_freq = float32_inv_freq(self.inv_freq, self.rope_dim, self.rope_base, self.inv_freq_fn)
        rope = rope_cos_sin(inv_freq, seq_len, h.dtype, position_ids, self.rope_attention_factor)
        h = self._blocks(h, rope, documents)
        if not self.last:
            # copies, not the inputs themselves: a stage's outputs must be no input or view of one (torch's
            # zero-bubble input pass detaches its outputs in place)
            return (h, *(c.clone() for c in carried)) if carried else h
        logits = self.output(self.norm(h))  # before the depths, as the whole model: the same gradient sums
        if self.mtp is None or not carried:
            return logits
        depths = self._mtp_depths(h, carried, rope, documents)
        return (logits, *(self.mtp.logits(d, self.output) for d in depths))

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

    def _mtp_depths(
        self, h: torch.Tensor, carried: tuple[torch.Tensor, ...], rope: Rope, documents: Documents | None
    ) -> list[torch.Tensor]:
        """The multi-token-prediction depths on the last stage, their routers' choices counted in a micro-batch's
        forward. Their router statistics feed no stage loss: the balancing loss, the one family loss over them, is
        refused under a pipeline (config/pipeline.py)."""
        side = self.mtp.sparse_blocks() if self.record_routing else []
        with router_stats([], also=side):
            return self.mtp.depths(h, list(carried), rope, documents)


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


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """No sequence shard: every token is this rank's."""
    return tensor
