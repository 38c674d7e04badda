"""Multi-token prediction (DeepSeek-V3's MTP, as XTuner trains it): D sequential depths after the main stack, each
predicting the token one further ahead through the model's shared embedding and head.

Depth k (1..D) at position t reads the hidden state h^{k-1}_t (h^0: the main stack's output before its final norm)
and the embedding of token t+k, and predicts token t+k+1:

    h^k = head_norm(block(eh_proj([enorm(Emb(ids rolled left by k)), hnorm(h^{k-1})])))
    logits^k = head(h^k)

The concat order is [embedding, hidden] (transformers' and XTuner's; the paper writes the reverse), `block` is one
full decoder block of the family (its own router), `head_norm` is the checkpoints' `shared_head.norm`. The ids are
rolled inside each packed document (positions restart at 0 where one begins): the slots past a document's end get
id 0 and carry no loss (the engine rolls the labels the same way, filling -100). RoPE keeps the unshifted positions
(relative, so the shift does not matter). With `share_weights` one physical layer runs at every depth. Qwen3-Next /
Qwen3.5 build the same layer with zero-centred norms, (1 + w) (their folders' `mtp.pre_fc_norm_*`, `mtp.norm`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from internlm_offload.model.attention import Documents
from internlm_offload.model.hooks import RecordsRouterStats
from internlm_offload.model.mlp import ParamInit, normal_init
from internlm_offload.model.norm import RMSNorm
from internlm_offload.model.tensor_plan import BlockPlan, SideBlock

# Where a decoder keeps its MTP layers (`Decoder.mtp`): the prefix of their parameters' names.
MTP_PREFIX = "mtp."
Rope = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class MtpSettings:
    """What the model builds and runs (config/mtp.py's section, resolved): `depth` D >= 1; the loss weight is the
    engine's."""

    depth: int
    share_weights: bool = False
    detach_inputs: bool = False  # the hidden state and the embeddings fed in, detached
    detach_head_weight: bool = False  # the logits through a detached head weight

    @property
    def physical(self) -> int:
        """The MTP layers built: one shared by every depth, or one per depth."""
        return 1 if self.share_weights else self.depth


def side_blocks(physical: int, plan: Callable[[int], BlockPlan]) -> tuple[SideBlock, ...]:
    """The layers in a family's tensor plan: layer k's block planned by `plan(k)` (the family's block L + k), its
    norms and eh_proj around it."""
    sides = []
    for k in range(physical):
        layer = f"{MTP_PREFIX}layers.{k}"
        norms = tuple(f"{layer}.{n}" for n in ("enorm", "hnorm", "head_norm"))
        sides.append(SideBlock(f"{layer}.block", plan(k), norms=norms, projections=(f"{layer}.eh_proj",)))
    return tuple(sides)


def roll_in_documents(x: torch.Tensor, shift: int, position_ids: torch.Tensor | None, fill: float) -> torch.Tensor:
    """(B, T) `x` moved left by `shift` inside each packed document of its row: x[t + shift] where that is in t's
    document, `fill` elsewhere (a row without `position_ids` is one document)."""
    length = x.shape[-1]
    rolled = x.roll(-shift, dims=-1)
    inside = torch.arange(length, device=x.device) < length - shift
    if position_ids is not None:
        document = (position_ids == 0).cumsum(-1)  # as model/attention.py's document mask numbers them
        inside = inside & (document.roll(-shift, dims=-1) == document)
    return torch.where(inside, rolled, torch.full_like(x, fill))


def embedded_inputs(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    depth: int,
    *,
    embed: Callable[[torch.Tensor], torch.Tensor],
    local: Callable[[torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """Each depth k's (1..`depth`) input embedding: the whole sequence's ids rolled by k inside their documents, then
    `local` keeps this rank's chunk (isp), then `embed` (a pipeline's first stage computes these and sends them on)."""
    return [embed(local(roll_in_documents(input_ids, k, position_ids, 0))) for k in range(1, depth + 1)]


class MtpLayer(nn.Module):
    """One depth's module: enorm and hnorm, eh_proj (Linear 2H -> H, no bias) on their concat, the decoder block,
    head_norm (the three norms (1 + w) with `zero_centred`)."""

    def __init__(self, hidden_size: int, norm_eps: float, block: nn.Module, zero_centred: bool = False) -> None:
        super().__init__()
        # registered in this order: the parameters' order (state dicts, optimizer groups) follows it
        self.enorm = RMSNorm(hidden_size, norm_eps, zero_centred)
        self.hnorm = RMSNorm(hidden_size, norm_eps, zero_centred)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.head_norm = RMSNorm(hidden_size, norm_eps, zero_centred)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope: Rope, documents: Documents | None):
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.head_norm(self.block(x, rope, documents))

    def param_inits(self, std: float, out_std: float) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        """Norms to ones (zero-centred: zeros), eh_proj normal(0, std), the block as its own."""
        yield from self.enorm.param_inits()
        yield from self.hnorm.param_inits()
        yield self.eh_proj.weight, normal_init(std)
        yield from self.block.param_inits(std, out_std)
        yield from self.head_norm.param_inits()

    def sparse_block(self) -> RecordsRouterStats | None:
        """The block's sparse feed-forward, if it has one."""
        ffn = getattr(self.block, "feed_forward", None)
        return ffn if isinstance(ffn, RecordsRouterStats) else None


class MultiTokenPrediction(nn.Module):
    """The D depths over `settings.physical` layers (`layers[k]` built by `block(k)`; their norms (1 + w) with
    `zero_centred`)."""

    def __init__(
        self,
        settings: MtpSettings,
        hidden_size: int,
        norm_eps: float,
        block: Callable[[int], nn.Module],
        zero_centred: bool = False,
    ) -> None:
        super().__init__()
        if settings.depth < 1:
            raise ValueError(f"multi-token prediction needs a depth >= 1, not {settings.depth}")
        self.settings = settings
        self.layers = nn.ModuleList(
            MtpLayer(hidden_size, norm_eps, block(k), zero_centred) for k in range(settings.physical)
        )

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        *,
        embed: Callable[[torch.Tensor], torch.Tensor],
        local: Callable[[torch.Tensor], torch.Tensor],
        rope: Rope,
        documents: Documents | None,
    ) -> list[torch.Tensor]:
        """Each depth's h^k (head-normed, before the head), for the main stack's `hidden` (pre-norm) and the whole
        sequence's `input_ids` / `position_ids`: `embedded_inputs`, then `depths`."""
        embedded = embedded_inputs(input_ids, position_ids, self.settings.depth, embed=embed, local=local)
        return self.depths(hidden, embedded, rope, documents)

    def depths(
        self, hidden: torch.Tensor, embedded: list[torch.Tensor], rope: Rope, documents: Documents | None
    ) -> list[torch.Tensor]:
        """Each depth's h^k from the main stack's `hidden` (pre-norm) and each depth's input embedding."""
        settings = self.settings
        h = hidden.detach() if settings.detach_inputs else hidden
        outs = []
        for k in range(1, settings.depth + 1):
            layer = self.layers[0 if settings.share_weights else k - 1]
            inputs = embedded[k - 1].detach() if settings.detach_inputs else embedded[k - 1]
            h = layer(h, inputs, rope, documents)
            sparse = layer.sparse_block()
            if sparse is not None and sparse.stats_sink is not None:
                # each call's choices, added now: a layer shared by the depths runs D times per forward
                sparse.record_load()
            outs.append(h)
        return outs

    def logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """The shared `head` on a depth's output (through a detached weight with `detach_head_weight`)."""
        if self.settings.detach_head_weight:
            return F.linear(hidden, head.weight.detach())
        return head(hidden)

    def sparse_blocks(self) -> list[RecordsRouterStats]:
        """The layers' sparse feed-forwards (one router each; shared by the depths with `share_weights`)."""
        return [s for layer in self.layers if (s := layer.sparse_block()) is not None]

    def param_inits(self, std: float, out_std: float) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        for layer in self.layers:
            yield from layer.param_inits(std, out_std)
