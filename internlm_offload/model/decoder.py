"""The decoder every native family builds on: embeddings, a stack of pre-norm blocks, the final norm and the head;
RoPE, packed documents and isp's sequence shard in the forward; the router statistics of its sparse blocks; and
the weights as data (`param_inits`: every parameter with its init, drawn in one order, so one process, DDP and
FSDP2 start bit-identical).

A family subclasses `Decoder`, hands it a factory of its blocks, and says which auxiliary losses its router
statistics make (`aux_losses`, and `stage_aux_losses` for a pipeline stage's share of them); its blocks are
`DecoderLayer`s of its own attention and feed-forward modules. With `mtp` settings it runs multi-token prediction
after the stack (model/mtp.py: its layers' blocks from the same factory, at indices `num_layers + k`), their logits
in `ModelOutput.mtp_logits`.
"""

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from internlm_offload.model.attention import Documents
from internlm_offload.model.hooks import HasTensorPlan, RecordsRouterStats, ShardsSequence
from internlm_offload.model.mlp import ParamInit, normal_init
from internlm_offload.model.mtp import MtpSettings, MultiTokenPrediction, side_blocks
from internlm_offload.model.norm import RMSNorm
from internlm_offload.model.output import ModelOutput
from internlm_offload.model.rope import InvFreqFn, float32_inv_freq, rope_cos_sin, rope_inv_freq
from internlm_offload.model.router import RouterStats
from internlm_offload.model.tensor_plan import BlockPlan, SideBlock

# What `Decoder.init_weights` does with each (parameter, init): by default `init(parameter)`.
ApplyInit = Callable[[nn.Parameter, ParamInit], None]
Rope = tuple[torch.Tensor, torch.Tensor]
# The auxiliary losses by name (unweighted) of some blocks' router statistics, in depth order.
AuxLossFn = Callable[[list[RouterStats]], dict[str, torch.Tensor]]


def no_aux_losses(stats: list[RouterStats]) -> dict[str, torch.Tensor]:
    """A model without auxiliary losses: none, whatever its router statistics."""
    return {}


def sparse_blocks(layers: Iterable[nn.Module]) -> list[RecordsRouterStats]:
    """The sparse blocks' feed-forwards among `layers` (decoder blocks), in their order."""
    return [layer.feed_forward for layer in layers if isinstance(layer.feed_forward, RecordsRouterStats)]


@contextlib.contextmanager
def router_stats(moes: list[RecordsRouterStats], also: list[RecordsRouterStats] = ()) -> Iterator[list[RouterStats]]:
    """The router statistics of the forward run inside, in `moes`' order, then `also`'s (multi-token prediction's
    sparse blocks, which record their choices per call); each of `moes`' tokens per expert recorded after
    (`record_load`).

    Only that forward fills the list: a block recomputed in backward finds no sink and keeps no graph alive.
    """
    stats: list[RouterStats] = []
    lent = [*moes, *also]
    for moe in lent:
        moe.stats_sink = stats
    try:
        yield stats
    finally:
        for moe in lent:
            moe.stats_sink = None
    for moe in moes:
        moe.record_load()


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then h + feed_forward(norm(h)).

    The attention takes (x, rope, documents); the feed-forward is a SwiGLU or a sparse block (`MoE`).
    """

    def __init__(
        self,
        hidden_size: int,
        norm_eps: float,
        attention: nn.Module,
        feed_forward: nn.Module,
        zero_centred_norms: bool = False,
    ) -> None:
        """`zero_centred_norms`: both norms (1 + w), w initialised to 0 (Qwen3-Next / Qwen3.5)."""
        super().__init__()
        # registered in this order: the parameters' order (state dicts, optimizer groups, DDP buckets) follows it
        self.attention_norm = RMSNorm(hidden_size, norm_eps, zero_centred_norms)
        self.attention = attention
        self.ffn_norm = RMSNorm(hidden_size, norm_eps, zero_centred_norms)
        self.feed_forward = feed_forward

    def forward(self, x: torch.Tensor, rope: Rope, documents: Documents | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, documents)
        return h + self.feed_forward(self.ffn_norm(h))

    def param_inits(self, std: float, out_std: float) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        """Norms to ones, the attention's and feed-forward's as theirs."""
        yield from self.attention_norm.param_inits()
        yield from self.attention.param_inits(std, out_std)
        yield from self.ffn_norm.param_inits()
        yield from self.feed_forward.param_inits(std, out_std)


class Decoder(nn.Module, HasTensorPlan, ShardsSequence):
    """Decoder-only LM: tok_embeddings -> layers -> norm -> output. Under isp it keeps its rank's chunk of the
    sequence (`sequence_shard`, model/hooks.py). `needs_documents`: its blocks get a `Documents` even for a row of
    one document (DSA hands its top-k between blocks through it, model/dsa.py).

    Built on meta, so that construction draws no random numbers: `init_weights` alone sets every weight, which makes
    a direct build equal a meta build + to_empty + init_weights under the same seed.
    """

    needs_documents = False

    def __init__(
        self,
        *,
        vocab_size: int,
        hidden_size: int,
        num_layers: int,
        norm_eps: float,
        rope_dim: int,
        rope_base: float,
        tie_word_embeddings: bool,
        init_std: float,
        block: Callable[[int], nn.Module],
        inv_freq_fn: InvFreqFn = rope_inv_freq,
        rope_attention_factor: float = 1.0,
        mtp: MtpSettings | None = None,
        zero_centred_norm: bool = False,
    ) -> None:
        """`block(i)` builds block i (on meta); RoPE rotates `rope_dim` dims of each head at base `rope_base`, at
        the frequencies `inv_freq_fn(rope_dim, rope_base, device)` makes, its cos and sin times
        `rope_attention_factor` (a family's scaled rope, e.g. YaRN: model/rope.py `rope_from_parameters`). `mtp`:
        multi-token prediction's layers after the head, their blocks `block(num_layers + k)`. `zero_centred_norm`:
        the final norm is (1 + w) (Qwen3-Next), and so are the MTP layers' norms."""
        super().__init__()
        self.num_layers = num_layers
        self.vocab_size = vocab_size
        self.rope_dim = rope_dim
        self.rope_base = rope_base
        self.inv_freq_fn = inv_freq_fn
        self.rope_attention_factor = rope_attention_factor
        self.init_std = init_std
        self.tie_word_embeddings = tie_word_embeddings
        device = torch.get_default_device()
        with torch.device("meta"):
            self.tok_embeddings = nn.Embedding(vocab_size, hidden_size)
            self.layers = nn.ModuleList(block(i) for i in range(num_layers))
            self.norm = RMSNorm(hidden_size, norm_eps, zero_centred_norm)
            self.output = nn.Linear(hidden_size, vocab_size, bias=False)
            self.mtp = (
                None
                if mtp is None
                else MultiTokenPrediction(
                    mtp, hidden_size, norm_eps, lambda k: block(num_layers + k), zero_centred=zero_centred_norm
                )
            )
            # Non-persistent: derived from config, so checkpoints hold only parameters.
            self.register_buffer("inv_freq", inv_freq_fn(rope_dim, rope_base, None), persistent=False)
        if tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.to_empty(device=device)
        self.init_weights()

    def init_weights(self, apply: ApplyInit | None = None) -> None:
        """Reset RoPE and set every weight from the current torch RNG (normal(0, init_std); residual outputs
        scaled), one parameter at a time in `param_inits` order. `apply(param, init)` replaces `init(param)`:
        a sharded build draws each parameter whole and keeps its shard, so it draws what this one does."""
        if self.tie_word_embeddings and self.output.weight is not self.tok_embeddings.weight:
            # to_empty from meta makes a new Parameter per module, which unties a shared weight
            self.output.weight = self.tok_embeddings.weight
        with torch.no_grad():
            self.inv_freq.copy_(self.inv_freq_fn(self.rope_dim, self.rope_base, self.inv_freq.device))
            for param, init in self.param_inits():
                if apply is None:
                    init(param)
                else:
                    apply(param, init)

    def param_inits(self) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        """Every parameter (a tied one once) with its init, in the order the seeded draws happen."""
        yield self.tok_embeddings.weight, normal_init(self.init_std)
        # GPT-2: shrink the projections that write into the residual stream so its variance stays flat in depth.
        out_std = self.init_std / math.sqrt(2 * self.num_layers)
        for layer in self.layers:
            yield from layer.param_inits(self.init_std, out_std)
        yield from self.norm.param_inits()
        if not self.tie_word_embeddings:
            yield self.output.weight, normal_init(self.init_std)
        if self.mtp is not None:  # last: the main model's draws are the same with multi-token prediction on or off
            yield from self.mtp.param_inits(self.init_std, out_std)

    def rope_cos_sin(self, seq_len: int, dtype: torch.dtype, position_ids: torch.Tensor | None = None) -> Rope:
        """(cos, sin) for positions 0..T-1, each (T, rope_dim), or for `position_ids` (B, T), each (B, T,
        rope_dim); computed in float32, cast to `dtype`."""
        inv_freq = float32_inv_freq(self.inv_freq, self.rope_dim, self.rope_base, self.inv_freq_fn)
        return rope_cos_sin(inv_freq, seq_len, dtype, position_ids, self.rope_attention_factor)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> ModelOutput:
        """Logits (B, T, V) for input_ids (B, T), in the model's dtype, and the auxiliary losses of its sparse blocks
        (`aux_losses`: fp32 scalars without their coefficients); in training, each multi-token-prediction depth's
        logits (`mtp_logits`, model/mtp.py).

        `position_ids` (B, T) packs several documents per row: positions restart at 0 where a document
        begins, and attention never crosses into another document. With a `sequence_shard` (isp) the
        logits are this rank's chunk of the sequence, (B, T / shard.size, V).
        """
        if position_ids is None and self.needs_documents:  # one document per row
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        documents = None if position_ids is None else Documents(position_ids)  # the whole sequence's
        whole_ids, whole_positions = input_ids, position_ids  # multi-token prediction rolls them before the split
        shard = self.sequence_shard
        if shard is not None:  # isp: this rank's chunk of the tokens, at their own positions
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
            input_ids, position_ids = shard.local(input_ids), shard.local(position_ids)
        h = self.tok_embeddings(input_ids)  # (B, T, C)
        rope = self.rope_cos_sin(input_ids.shape[1], h.dtype, position_ids)
        with router_stats(self.moe_layers(), also=self._mtp_sparse_blocks()) as stats:
            for layer in self.layers:
                h = layer(h, rope, documents)
            logits = self.output(self.norm(h))  # (B, T, V)
            mtp_logits = ()
            if self.mtp is not None and self.training:  # validation's loss is the language model's alone
                local = shard.local if shard is not None else _whole
                depths = self.mtp(
                    h,
                    whole_ids,
                    whole_positions,
                    embed=self.tok_embeddings,
                    local=local,
                    rope=rope,
                    documents=documents,
                )
                mtp_logits = tuple(self.mtp.logits(d, self.output) for d in depths)
        return ModelOutput(logits, self.aux_losses(stats), mtp_logits)

    def mtp_side_blocks(self, block_plan: Callable[[int], BlockPlan]) -> tuple[SideBlock, ...]:
        """Multi-token prediction's layers for the tensor plan (none without them): layer k's block planned as the
        family's block `num_layers + k` (`block_plan(i)`), its norms and eh_proj around it."""
        if self.mtp is None:
            return ()
        return side_blocks(self.mtp.settings.physical, lambda k: block_plan(self.num_layers + k))

    def aux_losses(self, stats: list[RouterStats]) -> dict[str, torch.Tensor]:
        """The auxiliary losses by name (model/output.py) of this forward's router statistics; none by default."""
        return {}

    def stage_aux_losses(self) -> AuxLossFn:
        """What a pipeline stage computes its blocks' auxiliary losses with (engine/pipeline_split.py): a function of
        their router statistics that holds none of the model's modules (a stage keeps it, not the whole model). The
        stages' losses add up to `aux_losses` of the whole forward: a family whose loss is no sum over blocks refuses
        a pipeline. By default none (`no_aux_losses`): a family that returns losses says how they split."""
        return no_aux_losses

    def moe_layers(self) -> list[RecordsRouterStats]:
        """The sparse blocks' feed-forwards, in depth order."""
        return sparse_blocks(self.layers)

    def _mtp_sparse_blocks(self) -> list[RecordsRouterStats]:
        """Multi-token prediction's sparse blocks (none without it)."""
        return self.mtp.sparse_blocks() if self.mtp is not None else []

    def tokens_per_expert(self) -> torch.Tensor:
        """(sparse blocks, E) fp32: tokens each expert computed in the last forward, after capacity (detached)."""
        return torch.stack([moe.tokens_per_expert for moe in self.moe_layers()])

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count (tied weights once); exclude_embeddings drops the tok_embeddings table."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_embeddings.weight.numel()
        return n


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """No sequence shard: every token is this rank's."""
    return tensor
