"""Tensor parallelism of InternEvo's `parallel.tensor` modes on torch's DTensor (`parallelize_module`).

What it may touch: the model's submodules, which it replaces parameters of by DTensors over the tensor
mesh; nothing else. The data-parallel wrappers (engine/parallel.py) come after it, the layer plan's
checkpoint and offload hooks act on the blocks it returns. Which module takes which role is the model family's
data (its `TensorPlan`, model/tensor_plan.py); the styles of each role are this module's. Below, InternLM2's names.

- `mtp` (Megatron TP): wq/wk/wv/w1/w3 column parallel, wo/w2 row parallel (their outputs all-reduced),
  norms replicated plain modules; the embedding vocab-parallel, the head column parallel. The column
  projections of a module share one DTensor input, so backward reduces its gradient once per module.
- `msp` (Megatron SP): mtp plus sequence-sharded activations between the column and row regions:
  norms are `SequenceParallel`, the block inputs all-gathered on the sequence before the projections and
  the row outputs reduce-scattered back (torchtitan's plan).
- `fsp` (flash-attn SP): msp's numerics; the projections' all-gathered inputs are not kept for backward
  but gathered again there (`gather_in_backward_again`): InternEvo's fsp memory.

A plan's side blocks (multi-token prediction's layers, `TensorPlan.side_blocks`) take the blocks' styles after them;
their norms are sequence parallel under msp / fsp, their input projection column parallel with its output gathered
back to the residual stream's layout (whole width in and out).

With `parallel_output` (InternEvo's default) the head's logits stay vocab-sharded and the loss runs under
`loss_parallel`; otherwise they are all-gathered. Each rank holds whole query heads and whole kv groups:
the model views its projections with -1 heads. Where the tensor size exceeds the kv heads, wk and wv stay
whole on every rank and each keeps the kv head of its query heads (`KVHeadReplicas`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from internlm_offload.config import ConfigError
from internlm_offload.engine.expert_tensor_parallel import SplitMoE
from internlm_offload.engine.model_plan import (
    check_model_names,
    check_names,
    planned_blocks,
    planned_module,
    tensor_plan,
)
from internlm_offload.engine.moe_tensor_parallel import WholeMoE, local_parameters, replicate_parameters
from internlm_offload.log import get_logger
from internlm_offload.model.hooks import SplitsHeadGroups
from internlm_offload.model.tensor_plan import BlockPlan
from internlm_offload.optim.dtensor import is_dtensor

logger = get_logger(__name__)

SEQUENCE_SHARDED = ("msp", "fsp")


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    mode: str,
    parallel_output: bool,
    gather_again_in: Collection[int] | None = None,
    split_experts: bool = False,
) -> None:
    """Shard `model` over `tp_mesh` in `mode`, module by module as its tensor plan says (refused without one).

    `gather_again_in`: the blocks fsp gathers again in backward (default all); the others run msp's plan.
    `split_experts`: the sparse blocks' experts split over the tensor group (`SplitMoE`, InternEvo's no_tp=False),
    else each sparse block whole on every rank (`WholeMoE`, no_tp=True).
    Activation offload and checkpointing save through saved-tensor hooks, which selective checkpointing's
    own saves bypass: the layer plan's offloaded and checkpointed blocks are left out."""
    if mode not in ("mtp", "msp", "fsp"):
        raise ValueError(f"parallel.tensor.mode={mode!r} has no column/row plan; expected mtp, msp or fsp")
    feature = f"parallel.tensor.mode={mode!r}"
    plan = tensor_plan(model, feature)
    blocks = list(planned_blocks(model, plan, feature))
    check_model_names(model, plan, feature)  # every name first: parallelize_module skips one it does not find
    for index, block, block_plan in blocks:
        check_names(block, index, _block_names(block_plan), feature)
        check_heads(index, block_plan, tp_mesh.size(), feature)
    sequence = mode in SEQUENCE_SHARDED
    between = Shard(1) if sequence else Replicate()  # the residual stream's layout between the blocks
    head_output = Shard(-1) if parallel_output else Replicate()
    top_plan = {
        plan.embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        plan.head: ColwiseParallel(
            input_layouts=between, output_layouts=head_output, use_local_output=not parallel_output
        ),
    }
    if sequence:
        top_plan[plan.final_norm] = SequenceParallel()
    for side in plan.side_blocks:  # multi-token prediction's norms and input projection around its block
        top_plan |= {name: SequenceParallel() for name in side.norms if sequence}
        # whole width in and out: the input gathered, the output's feature shards gathered back to the residual layout
        top_plan |= {name: ColwiseParallel(input_layouts=between, output_layouts=between) for name in side.projections}
    parallelize_module(model, tp_mesh, top_plan)
    for index, block, block_plan in blocks:
        block_mode = mode
        if mode == "fsp" and gather_again_in is not None and index not in gather_again_in:
            block_mode = "msp"
        parallelize_module(block, tp_mesh, _block_styles(block_mode, block_plan, tp_mesh.size(), split_experts))
        for name in block_plan.head_params:
            split_with_heads(block, name, tp_mesh)
        if block_plan.attention.whole_parameters:
            attention = planned_module(block, index, block_plan.attention.module, feature)
            parallelize_module(attention, tp_mesh, WholeParameters())
        if block_mode == "fsp":
            attention = planned_module(block, index, block_plan.attention.module, feature)
            gather_in_backward_again(attention, local=bool(block_plan.attention.replicated))
            if not block_plan.sparse:  # a sparse block gathers its own input (SplitMoE) or routes its chunk
                gather_in_backward_again(planned_module(block, index, block_plan.feed_forward.module, feature))
    logger.info(
        "Applied tensor parallel %s over %d ranks (%s logits)",
        mode,
        tp_mesh.size(),
        "vocab-sharded" if parallel_output else "gathered",
    )


def _block_names(plan: BlockPlan) -> list[str]:
    """Every module a block's plan names."""
    attention, feed_forward = plan.attention, plan.feed_forward
    regions = [attention.module, *attention.column, *attention.row, feed_forward.module, *feed_forward.column]
    return [*regions, *feed_forward.row, *plan.kv, *plan.norms, *(r.module for r in attention.replicated)]


def split_with_heads(block: nn.Module, name: str, tp_mesh: DeviceMesh) -> None:
    """A per-head parameter of the attention (`BlockPlan.head_params`: GPT-OSS's sinks) sharded on dim 0 as the
    column projections shard their heads: rank r keeps the entries of its query heads; the module reads it as a
    local tensor (`to_local`), whose gradient comes back as this shard's."""
    path, _, attr = name.rpartition(".")
    module = block.get_submodule(path)
    param = getattr(module, attr)
    # src_data_rank=None: every rank built the same whole tensor (the seed's draw, or meta): each cuts its own rows
    sharded = distribute_tensor(param.data, tp_mesh, [Shard(0)], src_data_rank=None)
    module.register_parameter(attr, nn.Parameter(sharded, requires_grad=param.requires_grad))


def check_heads(index: int, plan: BlockPlan, tensor_size: int, feature: str) -> None:
    """A block whose plan states its heads (a model whose config section does not hold them): the tensor size divides
    its query heads, and its kv heads or is divided by them (each rank attends with whole heads)."""
    heads, kv_heads = plan.heads, plan.kv_heads
    if heads and (heads % tensor_size or (kv_heads % tensor_size and tensor_size % kv_heads)):
        raise ConfigError(
            f"{feature} over {tensor_size} ranks: block {index} has {heads} query heads and {kv_heads} kv heads; the "
            "tensor size must divide the query heads and divide or be a multiple of the kv heads"
        )


def _block_styles(
    mode: str, plan: BlockPlan, tensor_size: int, split_experts: bool = False
) -> dict[str, ParallelStyle]:
    """One decoder block's styles: column-parallel projections in, row-parallel out (torchtitan's shape); a sparse
    block with its experts split over the ranks (`SplitMoE`) or whole on every rank, routing this rank's sequence
    chunk (`WholeMoE`)."""
    sequence = mode in SEQUENCE_SHARDED
    kv = ColwiseParallel() if plan.kv_heads % tensor_size == 0 else KVHeadReplicas(plan.kv_heads)
    attention, feed_forward = plan.attention, plan.feed_forward
    styles: dict[str, ParallelStyle] = {name: ColwiseParallel() for name in attention.column}
    styles |= {name: kv for name in plan.kv}
    styles |= {r.module: ReadWholeTail(r.read_whole) for r in attention.replicated if r.read_whole}
    styles |= {name: _row(sequence) for name in attention.row}
    if plan.sparse:
        moe_style = SplitMoE if split_experts else WholeMoE
        styles[feed_forward.module] = moe_style(sequence_sharded=sequence)
    else:
        styles |= {name: ColwiseParallel() for name in feed_forward.column}
        styles |= {name: _row(sequence) for name in feed_forward.row}
    if sequence:
        styles |= {name: SequenceParallel() for name in plan.norms}
    if mode != "fsp":  # fsp gathers inside its checkpointed region instead
        # only the residual stream is laid out (attention's rope and documents are left alone)
        layout = Shard(1) if sequence else Replicate()
        prepare = _whole_input if attention.replicated else _shared_input
        styles[attention.module] = prepare(layout, extra_args=attention.extra_args)
        if not plan.sparse:
            styles[feed_forward.module] = _shared_input(layout, extra_args=feed_forward.extra_args)
    return styles


def _row(sequence: bool) -> RowwiseParallel:
    """A row-parallel projection: its output reduce-scattered to the sequence (msp, fsp) or all-reduced (mtp)."""
    return RowwiseParallel(output_layouts=Shard(1) if sequence else Replicate())


def _shared_input(layout: Shard | Replicate, extra_args: int) -> PrepareModuleInput:
    """A module's first argument (in `layout`) as one replicated DTensor its column-parallel projections share
    (all-gathered on the sequence from Shard(1)); the rest left alone. Shared, the projections' Partial input
    gradients add up locally and are reduced once (a reduce-scatter back to Shard(1), an all-reduce for a
    replicated input); a plain tensor would be wrapped by each projection and all-reduced by each."""
    rest = (None,) * extra_args
    return PrepareModuleInput(
        input_layouts=(layout, *rest), desired_input_layouts=(Replicate(), *rest), use_local_output=False
    )


def _whole_input(layout: Shard | Replicate, extra_args: int) -> PrepareModuleInput:
    """A module's first argument (in `layout`) as a plain whole tensor, for a region whose first projections are
    replicated (`Region.replicated`): they take plain tensors, and the column projections after them each sum their
    input gradient over the tensor group, so the gradient arriving here is whole (under msp / fsp this rank keeps its
    chunk of it)."""
    rest = (None,) * extra_args
    return PrepareModuleInput(
        input_layouts=(layout, *rest), desired_input_layouts=(Replicate(), *rest), use_local_output=True
    )


@dataclass(frozen=True)
class HeadGroups:
    """This rank's whole head groups: the `rank`-th of `size` equal runs over `mesh` (model/hooks.py
    `HeadGroupSplit`)."""

    mesh: DeviceMesh
    rank: int
    size: int

    def local_input(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (the shared replicated DTensor, or a plain whole tensor) as a local tensor whose gradient is `Partial`:
        summed over the tensor group with the column projections' (the shared input's one reduction), or by its own
        all-reduce for a plain input."""
        if not is_dtensor(x):
            x = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        return x.to_local(grad_placements=[Partial()])


class WholeParameters(ParallelStyle):
    """A mixer's parameters that its column / row styles left plain (per-head norms, a depthwise conv, per-head decay
    rates) become replicated DTensors, whole on every rank, seen as local tensors in its forward with `Partial`
    gradients: each rank's part (its heads') is summed over the tensor group (`align_grads_in_backward`, or FSDP2's
    redistribution). A `SplitsHeadGroups` mixer is told its rank's head groups, whose channels and rates it reads."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        slots = replicate_parameters(module, device_mesh)
        if isinstance(module, SplitsHeadGroups):
            module.head_groups = HeadGroups(device_mesh, device_mesh.get_local_rank(), device_mesh.size())
        forward = module.forward

        @functools.wraps(forward)
        def local_forward(*args, **kwargs):
            with local_parameters(slots, device_mesh):
                return forward(*args, **kwargs)

        module.forward = local_forward
        return module


class ReadWholeTail(ParallelStyle):
    """A replicated projection whose last `width` outputs every rank's heads read as they are, past the column
    projections (MLA's kv_a_proj_with_mqa and its rope key, as transformers' `mla_kv_a_proj`): their gradient, each
    rank's heads' part, is summed over the tensor group in backward. The rest of its output reaches the heads through
    column projections, whose input gradients are summed already; its weight stays a plain tensor, whole on every
    rank, and gets the whole gradient."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(functools.partial(self._sum_tail_gradient, device_mesh=device_mesh))
        return module

    def _sum_tail_gradient(
        self, module: nn.Module, inputs: tuple, output: torch.Tensor, device_mesh: DeviceMesh
    ) -> torch.Tensor:
        head, tail = output.split([output.shape[-1] - self.width, self.width], dim=-1)
        # no communication forward; backward, the Partial gradient is all-reduced back to the replicated layout
        tail = DTensor.from_local(tail, device_mesh, [Replicate()], run_check=False).to_local(
            grad_placements=[Partial()]
        )
        return torch.cat((head, tail), dim=-1)


class KVHeadReplicas(ParallelStyle):
    """wk or wv where the tensor size T exceeds the kv heads (T a multiple of them): the weight stays whole on
    every rank (replicated) and each rank keeps the output of kv head `rank // (T / kv_heads)`, the group of
    its query heads (InternEvo's rule, as isp's all-to-all repeats them). The output's gradient is marked
    Partial: the T / kv_heads ranks of one head add up their query heads' parts in the weight's gradient
    reduction (`align_grads_in_backward`) and in the shared input's."""

    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.kv_heads = kv_heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=_replicated_input, output_fn=self._own_kv_head)

    def _own_kv_head(self, module: nn.Module, output: DTensor, device_mesh: DeviceMesh) -> torch.Tensor:
        width = output.shape[-1] // self.kv_heads
        head = device_mesh.get_local_rank() // (device_mesh.size() // self.kv_heads)
        return output.to_local(grad_placements=[Partial()]).narrow(-1, head * width, width)


def _replicated_input(module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
    """The projection's input as a replicated DTensor (it arrives as one where the module shares it)."""
    x = inputs[0]
    if not is_dtensor(x):
        x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
    return (x, *inputs[1:])


# What fsp keeps of a column region in forward: the matmul and attention outputs. The rest (the sequence
# all-gather of the region's input above all, and the cheap elementwise ops) runs again in backward.
_SAVED_IN_FSP = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _fsp_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_IN_FSP else CheckpointPolicy.PREFER_RECOMPUTE


def gather_in_backward_again(module: nn.Module, *, local: bool = False) -> None:
    """fsp: `module` takes its input sequence-sharded, all-gathers it itself and runs under selective
    checkpointing that saves only the matmul and attention outputs: backward keeps the sharded input (1/T
    of msp's gathered one) and gathers it again, as InternEvo's fsp does. `local`: the gathered input handed on as
    a plain tensor (a region with replicated projections: `_whole_input`), else as the DTensor they share."""
    forward = module.forward
    contexts = functools.partial(create_selective_checkpoint_contexts, _fsp_policy)

    def gathered(x: DTensor, *args, **kwargs):  # a DTensor the projections share (see `_shared_input`)
        whole = x.redistribute(placements=[Replicate()])
        return forward(whole.to_local() if local else whole, *args, **kwargs)

    @functools.wraps(forward)
    def sharded_input_forward(x: DTensor, *args, **kwargs):
        return checkpoint(gathered, x, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    module.forward = sharded_input_forward


def loss_context(parallel_output: bool) -> contextlib.AbstractContextManager:
    """Where the forward, the loss and its backward run: `loss_parallel` when logits are vocab-sharded."""
    return loss_parallel() if parallel_output else contextlib.nullcontext()


def align_grads_in_backward(model: nn.Module) -> None:
    """Give every DTensor gradient its parameter's layout as soon as backward accumulates it: `Partial`
    gradients of replicated parameters (sequence-parallel norms) are summed over the tensor group, a
    replicated gradient of a sharded one (the vocab-parallel embedding's) is cut to this rank's shard.
    Registered first, so the hooks that take gradients later (gradient offload, the hybrid optimizer's
    host copies) and the masters, clipping and the optimizer all read each gradient as its parameter's
    local shard. (FSDP2 replaces the parameters with its own and lays out their gradients itself.)"""
    for param in model.parameters():
        if is_dtensor(param) and param.requires_grad:
            param.register_post_accumulate_grad_hook(_align_grad)


@torch.no_grad()
def _align_grad(param: torch.Tensor) -> None:
    grad = param.grad
    if is_dtensor(grad) and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(placements=param.placements)


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor (a replicated DTensor under `loss_parallel`)."""
    return loss.full_tensor() if is_dtensor(loss) else loss
