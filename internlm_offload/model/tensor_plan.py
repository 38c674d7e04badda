"""A model family's tensor plan: its modules by parallel role, as data the engine maps to torch's ParallelStyles.

The family names its modules (InternLM2's `attention.wq`, `feed_forward.w1`, `tok_embeddings`, ...) and says which
blocks are sparse; engine/tensor_parallel.py owns the styles (column, row, sequence parallel, the kv replicas, the
whole sparse block), and isp (engine/sequence_parallel.py) and expert parallel (engine/expert_parallel.py) find the
attention and the sparse blocks through the same names. Names are module paths as `nn.Module.get_submodule` takes
them: a block's relative to the block, the model-level ones relative to the model. A model offers its plan through
model/hooks.py's `HasTensorPlan`.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Replicated:
    """A projection or norm of a region kept whole on every tensor rank, ahead of its column projections (MLA's
    q_a_proj, kv_a_proj_with_mqa and their latent norms). `read_whole`: its last outputs that every rank's heads
    read as they are, past the column projections (MLA's rope key, shared by all heads): their gradient, each rank's
    heads' part, is summed over the tensor group."""

    module: str
    read_whole: int = 0


@dataclass(frozen=True)
class Region:
    """A sub-module of a block that takes the residual stream as its first argument: column-parallel projections in
    (output dim sharded), row-parallel ones out (input dim sharded, outputs reduced). An attention with `replicated`
    modules ahead of its column ones takes its input whole as a plain tensor (gathered from the sequence under msp /
    fsp), and each column projection sums its own input gradient over the tensor group. `whole_parameters`: what
    its column and row projections leave, whole on every rank with summed gradients (per-head weights each rank
    reads for its own heads)."""

    module: str
    column: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    # positional arguments after the residual stream, passed on as they are (attention's rope and documents)
    extra_args: int = 0
    replicated: tuple[Replicated, ...] = ()
    # its parameters outside the column / row projections (per-head norms, a conv, decay rates) whole on every rank,
    # read locally in its forward and their gradients summed over the tensor group; a model/hooks.py
    # `SplitsHeadGroups` module is told its rank's head groups (Gated DeltaNet)
    whole_parameters: bool = False


@dataclass(frozen=True)
class BlockPlan:
    """One decoder block's modules by role.

    `attention`: the token mixer (isp exchanges heads for sequence in it, fsp gathers its input again in backward);
    `kv`: its key and value projections over `kv_heads` heads (column parallel where the tensor size divides them,
    else whole on every rank, each keeping its query heads' kv head); `heads`: its query heads, which the tensor size
    must divide where the model's config section does not say them (0: the config checks); `feed_forward`: the MLP
    after it, or with
    `sparse` a sparse block (a model/hooks.py `DispatchesExperts`: whole on every tensor rank, its experts what
    expert parallel shards, or its experts split over the tensor group with `parallel.expert.no_tp=False`), whose
    column and row are then empty; `norms`: replicated, sequence parallel under
    msp / fsp; `head_params`: parameters of the attention with one entry per query head on dim 0 (GPT-OSS's sinks,
    block-relative names such as "attention.sinks"), split with the heads under mtp / msp / fsp and cut to this
    rank's heads under isp (by the attention itself: model/hooks.py `SequenceExchange.own_heads`).
    """

    attention: Region
    kv: tuple[str, ...]
    kv_heads: int
    feed_forward: Region
    sparse: bool = False
    norms: tuple[str, ...] = ()
    heads: int = 0
    head_params: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.sparse and (self.feed_forward.column or self.feed_forward.row):
            raise ValueError(f"a sparse block {self.feed_forward.module!r} stays whole: it has no column/row plan")


@dataclass(frozen=True)
class SideBlock:
    """A decoder block outside `model.layers` that the model runs on the residual stream after them (multi-token
    prediction's, model/mtp.py), with the modules around it: `block` (its path in the model) planned as the others,
    after them in depth order; `norms` (model-level paths) replicated, sequence parallel under msp / fsp;
    `projections` (model-level linears of whole width in and out) column parallel, their outputs gathered back to the
    residual stream's layout."""

    block: str
    plan: BlockPlan
    norms: tuple[str, ...] = ()
    projections: tuple[str, ...] = ()


@dataclass(frozen=True)
class TensorPlan:
    """A decoder's tensor plan: the model-level modules and one `BlockPlan` per entry of `model.layers`.

    `embedding`: vocab-parallel; `head`: column parallel over the vocabulary; `final_norm`: sequence parallel under
    msp / fsp; `side_blocks`: the blocks after `model.layers` (`SideBlock`), numbered on from them.
    """

    embedding: str
    final_norm: str
    head: str
    blocks: tuple[BlockPlan, ...]
    side_blocks: tuple[SideBlock, ...] = ()

    def sparse_blocks(self) -> list[int]:
        """The indices of the blocks whose feed-forward is a sparse block."""
        return [index for index, block in enumerate(self.blocks) if block.sparse]
