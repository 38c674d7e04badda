"""mtp / msp / fsp on a mixture of experts with InternEvo's `parallel.expert.no_tp=False` (its default): every routed
expert split over the tensor group, as Megatron's and InternEvo's expert tensor parallel.

What it may touch: a sparse block's `feed_forward` (the `MoE`): its routed experts' stacked weights and the shared
experts' projections become DTensors over "tp", its `expert_split` is set and its forward wrapped. The attention
and the dense blocks keep engine/tensor_parallel.py's column/row plan; `WholeMoE` (engine/moe_tensor_parallel.py)
is the no_tp=True alternative.

The rule, from the data flow:

- Weights: rank r holds a 1/T slice of every routed expert's intermediate dim: w1, w3 (E, I, H) and b1, b3 (E, I)
  on I (their output rows), w2 (E, H, I) on I (its input columns); the shared experts as the dense MLP (w1, w3
  column parallel, w2 row parallel). The activation (SwiGLU, GPT-OSS's clamped one) is elementwise on I, so each
  rank's slice of it is exact. b2 (E, H) stays whole on every rank, added by the first tensor rank only
  (`GroupedExperts.b2_share`): the sum over the ranks holds it once.
- Tokens: every tensor rank routes the same tokens, all of them. mtp's input is whole on every rank already;
  msp / fsp's is sequence-sharded, so it is all-gathered first (as the dense MLP's). The router, its capacity and
  aux loss are then one process's (the aux loss is not divided over the tensor ranks: `aux_chunks` is 1).
- Output: each rank's routed and shared outputs are its part of a sum; the block's output is summed over "tp" once,
  an all-reduce under mtp, a reduce-scatter back to the sequence under msp / fsp (as the dense MLP's row output).
  fsp keeps the gathered input for backward (msp's memory in the sparse blocks: the routing is not run again).
- Backward: what feeds a partial output (the experts' input rows, the shared experts' input, the combine weights,
  the shared gate) is read through `PartialReaders`, whose backward sums its gradient over "tp" (Megatron's copy to
  the tensor region); the router reads the input as it is, its gradient whole on every rank. So the router and the
  gate keep plain weights whose gradients are the same on every tensor rank (as mtp's norms), each expert slice's
  gradient is its own, and b2's (a replicated DTensor read with a `Partial` gradient) is summed over "tp".
- Expert parallel is carved from the data-parallel ranks only in this layout, InternEvo's expert-data group; this
  module does not build it (config/resolve.py refuses it in one line).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from internlm_offload.config import ConfigError
from internlm_offload.model.hooks import DispatchesExperts
from internlm_offload.optim.dtensor import is_dtensor

# the routed experts' stacked tensors and the dim of I each is split on (model/experts.py `GroupedExperts`)
ROUTED_SPLIT = {"w1": 1, "w3": 1, "w2": 2, "b1": 1, "b3": 1}
# the shared experts' projections (model/mlp.py `FeedForward`, nn.Linear (out, in)): column, column, row
SHARED_SPLIT = {"w1": 0, "w3": 0, "w2": 1}

Slot = tuple[nn.Module, str]  # a parameter's place: its module and its name there


@dataclass(frozen=True)
class PartialReaders:
    """A whole tensor read into this rank's part of a summed output (model/hooks.py `ExpertSplitFn`): as it is
    forward; backward, its gradient (this rank's part) is summed over `mesh`."""

    mesh: DeviceMesh

    def __deepcopy__(self, memo: dict) -> PartialReaders:
        # a mesh holds process groups: a copy of the model (the fp32 masters' module) reads through the same one
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # from_local's backward turns the Partial gradient into its Replicate placement: one all-reduce
        return DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class SplitMoE(ParallelStyle):
    """A sparse block's `MoE` with every expert split over the tensor group (module docstring). `sequence_sharded`:
    msp / fsp, whose input is gathered from the sequence and whose output is reduce-scattered back to it."""

    def __init__(self, sequence_sharded: bool) -> None:
        super().__init__()
        self.sequence_sharded = sequence_sharded

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, DispatchesExperts):
            raise TypeError(f"{type(module).__name__} is no sparse block (model/hooks.py DispatchesExperts)")
        slots = split_experts(module, device_mesh)
        module.expert_split = PartialReaders(device_mesh)
        forward = module.forward
        sequence = self.sequence_sharded

        @functools.wraps(forward)
        def split_forward(x: torch.Tensor) -> torch.Tensor:
            with local_views(slots):
                out = forward(_whole_input(x, device_mesh, sequence))
            return _summed(out, device_mesh, sequence)

        module.forward = split_forward
        return module


def split_experts(moe: DispatchesExperts, mesh: DeviceMesh) -> list[Slot]:
    """Shard `moe`'s routed and shared experts over `mesh` (every rank built the same whole weights; each keeps its
    slice, no communication); b2 replicated, added by the first rank. Returns the slots its forward reads locally."""
    size, experts, slots = mesh.size(), moe.experts, []
    for name, dim in ROUTED_SPLIT.items():
        if getattr(experts, name, None) is not None:
            _check_divides(getattr(experts, name).shape[dim], size, "the routed experts' intermediate size")
            _shard(experts, name, mesh, dim)
    if getattr(experts, "b2", None) is not None:
        whole = DTensor.from_local(experts.b2.data, mesh, [Replicate()], run_check=False)
        experts.b2 = nn.Parameter(whole, requires_grad=experts.b2.requires_grad)
        experts.b2_share = 1.0 if mesh.get_local_rank() == 0 else 0.0
        slots.append((experts, "b2"))
    shared = getattr(moe, "shared_experts", None)
    if shared is not None:
        for name, dim in SHARED_SPLIT.items():
            linear = getattr(shared, name)
            _check_divides(linear.weight.shape[dim], size, "the shared experts' intermediate size")
            _shard(linear, "weight", mesh, dim)
            slots.append((linear, "weight"))
    return slots


def _check_divides(width: int, size: int, what: str) -> None:
    if width % size:
        raise ConfigError(
            f"parallel.tensor.size={size} with parallel.expert.no_tp=False splits {what} ({width}) over the tensor "
            "ranks: it must divide it; set parallel.expert.no_tp=True (experts whole on every tensor rank)"
        )


@torch.no_grad()
def _shard(module: nn.Module, name: str, mesh: DeviceMesh, dim: int) -> None:
    """`module.name` sharded on `dim` over `mesh`; each rank cuts its part of the whole tensor it built."""
    param = getattr(module, name)
    sharded = distribute_tensor(param.data, mesh, [Shard(dim)], src_data_rank=None)
    setattr(module, name, nn.Parameter(sharded, requires_grad=param.requires_grad))


@contextlib.contextmanager
def local_views(slots: list[Slot]) -> Iterator[None]:
    """The DTensor parameters in `slots` seen as their local tensors during a forward, restored after: a shard's
    gradient is its own, a replicated one's (b2, which only the first rank adds) `Partial`, summed over the tensor
    group where the tensor plan's sums run (`align_grads_in_backward`, or FSDP2's redistribution)."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for sub, name in slots:
            param = sub._parameters[name]
            if not is_dtensor(param):
                continue
            swapped.append((sub, name, param))
            grads = [Partial() if p.is_replicate() else p for p in param.placements]
            # a plain tensor in the slot for this forward only (module.__setattr__ takes Parameters alone)
            sub._parameters[name] = param.to_local(grad_placements=grads)
        yield
    finally:
        for sub, name, param in swapped:
            sub._parameters[name] = param


def _whole_input(x: torch.Tensor, mesh: DeviceMesh, sequence: bool) -> torch.Tensor:
    """The block's input whole on every tensor rank, a plain tensor: msp / fsp gather it from the sequence (its
    gradient, whole on every rank, comes back as this rank's chunk), mtp's is whole already."""
    if not sequence:
        return x.to_local() if is_dtensor(x) else x
    chunk = x if is_dtensor(x) else DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
    return chunk.redistribute(placements=[Replicate()]).to_local()


def _summed(out: torch.Tensor, mesh: DeviceMesh, sequence: bool) -> torch.Tensor:
    """This rank's part of the block's output summed over the tensor group: reduce-scattered back to the sequence
    (msp / fsp) or all-reduced (mtp); its gradient, whole, is read as it is (all-gathered from the chunks first)."""
    partial = DTensor.from_local(out, mesh, [Partial()], run_check=False)
    return partial.redistribute(placements=[Shard(1) if sequence else Replicate()]).to_local()
