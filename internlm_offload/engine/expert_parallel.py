"""Expert parallel: each sparse block's routed experts split over the "ep" dim of the expert mesh.

What it may touch: every sparse block's `experts` (their stacked weights become DTensors sharded on dim 0 over
"ep": a rank holds E / ep experts) and its `expert_dispatch` (set here); nothing else. The sparse blocks are those
the model's tensor plan names, each a model/hooks.py `DispatchesExperts` (refused in one line otherwise). Routing,
capacity and the combine stay the block's own, on this rank's tokens: GShard's capacity is computed from the local
token count, as InternEvo does (each rank drops on its own), so the dropped choices are those of the same rank
without expert parallel.

The mesh is ("edp", "ep") over the data-parallel ranks (every rank where the tensor ranks route their own sequence
chunks: isp, and mtp/msp/fsp with whole experts, engine/moe_tensor_parallel.py), "ep" innermost (InternEvo's order:
expert ranks contiguous, expert-data ranks at stride ep); under expert weight parallel "edp" is split into
("edp_replicate", "edp_shard") (engine/runtime.py). Ranks of one "edp" group hold the same experts; their gradients
are summed over it and divided by the ranks whose losses the step averages (`RunContext.expert_grad_divisor`; the
dense convention: the mean over every rank's tokens;
InternEvo averages over "edp" only, ep times larger): under DDP by `reduce_expert_grads_in_backward`, under FSDP2
by the experts' own FSDP2 unit over "edp" (engine/parallel.py's `shard_experts`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from internlm_offload.engine.model_plan import sparse_blocks
from internlm_offload.engine.runtime import all_expert_data
from internlm_offload.log import get_logger
from internlm_offload.model.hooks import DispatchesExperts

logger = get_logger(__name__)


@dataclass(frozen=True)
class ExpertDispatch:
    """Sends each routed row to the rank holding its expert and brings the outputs back in the original order."""

    group: dist.ProcessGroup
    size: int

    def __deepcopy__(self, memo: dict) -> "ExpertDispatch":
        # A process group cannot be copied; a copy of the model (the fp32 masters' module) sends over the same one.
        return self

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """rows (N, H) sorted by global expert (dropped rows last), counts (E,) rows per expert: the experts'
        (N, H) outputs, 0 for the dropped rows, computed by the ranks that hold each expert."""
        return self.route(rows, counts, experts, *self.split_sizes(counts))

    def split_sizes(self, counts: torch.Tensor) -> tuple[list[int], list[int]]:
        """Counts exchanged: (rows this rank sends to each global expert, rows each rank r sends to my local
        expert j at r * E_local + j), as Python ints."""
        sent = counts.to(torch.int64)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.group)
        # The one host sync of the exchange: all_to_all_single takes its split sizes as Python ints.
        sizes = torch.cat([sent, received]).tolist()
        return sizes[: counts.numel()], sizes[counts.numel() :]

    def route(
        self,
        rows: torch.Tensor,
        counts: torch.Tensor,
        experts: nn.Module,
        sent_sizes: list[int],
        received_sizes: list[int],
    ) -> torch.Tensor:
        """`__call__` once the split sizes are known (the planner's trace assumes them: planner/standins.py)."""
        local = counts.numel() // self.size
        send_splits = [sum(sent_sizes[r * local : (r + 1) * local]) for r in range(self.size)]
        receive_splits = [sum(received_sizes[r * local : (r + 1) * local]) for r in range(self.size)]
        kept = sum(send_splits)
        incoming = _exchange(rows[:kept], receive_splits, send_splits, self.group)
        # Arrived grouped by source rank, then local expert; the grouped GEMM wants them by local expert.
        expert_major = [r * local + j for j in range(local) for r in range(self.size)]
        chunks = incoming.split(received_sizes)
        by_expert = torch.cat([chunks[i] for i in expert_major])
        local_counts = torch.tensor(
            [sum(received_sizes[j::local]) for j in range(local)], dtype=counts.dtype, device=counts.device
        )
        out = experts(by_expert, local_counts).split([received_sizes[i] for i in expert_major])
        source_major = [None] * len(out)
        for position, i in enumerate(expert_major):
            source_major[i] = out[position]
        returned = _exchange(torch.cat(source_major), send_splits, receive_splits, self.group)
        return torch.cat([returned, rows.new_zeros(rows.shape[0] - kept, rows.shape[1])])


def _exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup):
    """torch's all_to_all_single with autograd (the backward sends the gradients back along the same splits)."""
    out = all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group)
    return out.wait() if hasattr(out, "wait") else out  # an AsyncCollectiveTensor until waited on


def moe_blocks(model: nn.Module) -> list[DispatchesExperts]:
    """The sparse blocks of `model` (after `apply_expert_parallel` checked them against the plan)."""
    return [m for m in model.modules() if isinstance(m, DispatchesExperts)]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard every sparse block's experts over `mesh["ep"]` (each rank keeps its slice of the whole weights it
    built from the seed) and route their rows through the all-to-all."""
    ep = mesh["ep"]
    # experts split over "tp" too (no_tp=False): whole over "tp" here, each rank's slice cut by the tensor plan
    # (engine/expert_tensor_parallel.py), so one DTensor over ("ep", "tp") holds both splits
    over_tensor = "tp" in (mesh.mesh_dim_names or ())
    placed, placements = (mesh["ep", "tp"], [Shard(0), Replicate()]) if over_tensor else (ep, [Shard(0)])
    blocks = sparse_blocks(model, f"parallel.expert.size={ep.size()}")
    dispatch = ExpertDispatch(group=ep.get_group(), size=ep.size())
    for moe in blocks:
        if moe.num_experts % ep.size():
            raise ValueError(f"{moe.num_experts} experts do not split over {ep.size()} expert-parallel ranks")
        experts = moe.experts
        for name, weight in list(experts.named_parameters(recurse=False)):  # stacked over the experts on dim 0
            # src_data_rank=None: every rank built the same whole weight; each keeps its slice, no communication
            shard = distribute_tensor(weight.detach(), placed, placements, src_data_rank=None)
            setattr(experts, name, nn.Parameter(shard, requires_grad=weight.requires_grad))
        moe.expert_dispatch = dispatch
    logger.info(
        "Applied expert parallel over %d ranks (%d expert-data groups): %d sparse blocks, %d of %d experts each",
        ep.size(),
        all_expert_data(mesh).size(),
        len(blocks),
        blocks[0].num_experts // ep.size() if blocks else 0,
        blocks[0].num_experts if blocks else 0,
    )


def expert_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The sparse blocks' routed expert weights (sharded over "ep" under expert parallel) with their names."""
    experts = {id(p) for moe in moe_blocks(model) for p in moe.experts.parameters()}
    return [(name, p) for name, p in model.named_parameters() if id(p) in experts]


def _mean_over_expert_data(mesh: DeviceMesh, ranks: int) -> Callable[[torch.Tensor], None]:
    """Sum a gradient (or a buffer of them) over the expert-data group, in place, and divide it by `ranks`
    (`RunContext.expert_grad_divisor`: the data-parallel ranks; every rank under isp, whose loss weighs each chunk
    as its share of the sequences): the mean over every rank's tokens, as the wrapper gives the other weights."""
    expert_data = all_expert_data(mesh)
    group = expert_data.get_group()
    reduce = expert_data.size() > 1

    @torch.no_grad()
    def mean(grads: torch.Tensor) -> None:
        if reduce:
            dist.all_reduce(grads, group=group)
        grads.div_(ranks)

    return mean


def expert_grad_reduction(
    model: nn.Module, mesh: DeviceMesh, ranks: int
) -> tuple[set[str], Callable[[torch.Tensor], None]]:
    """For fp32 masters (engine/precision.py, which reduces their gradients after backward, side by side in one
    buffer): the expert weights' names, and how that buffer is reduced (as `reduce_expert_grads_in_backward`
    reduces each gradient)."""
    return {name for name, _ in expert_params(model)}, _mean_over_expert_data(mesh, ranks)


def reduce_expert_grads_in_backward(model: nn.Module, mesh: DeviceMesh, ranks: int, sync: Callable[[], bool]) -> None:
    """DDP leaves the experts alone (their gradients differ across "ep"); when `sync()` says this backward is
    the step's last, each expert gradient is averaged over the expert-data group as soon as backward
    accumulates it."""
    mean = _mean_over_expert_data(mesh, ranks)

    def hook(param: torch.Tensor) -> None:
        if sync():
            mean(param.grad.to_local())

    for _, param in expert_params(model):
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(hook)
