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
  gradient is its own, and b2 (a DTensor whole over "tp") is read through `PartialReaders` too, inside the experts'
  own forward, so its gradient is summed over "tp" before it reaches the parameter.
- Expert parallel is carved from the data-parallel ranks only in this layout (InternEvo's: its expert tensor
  group is the tensor group): the expert mesh is ("edp", "ep", "tp") over the world (engine/runtime.py), and
  engine/expert_parallel.py places each stacked weight over ("ep", "tp") as [Shard(0), Replicate()], whose "tp"
  placement this module turns into the intermediate split; b2 stays [Shard(0), Replicate()]. The dispatch's
  all-to-all runs within "ep", between ranks of one tensor rank, which hold the same slice of different experts.
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
        module.expert_split = reader = PartialReaders(device_mesh)
        slots = split_experts(module, device_mesh, reader)
        forward = module.forward
        sequence = self.sequence_sharded

        @functools.wraps(forward)
        def split_forward(x: torch.Tensor) -> torch.Tensor:
            with local_views(slots, reader):
                out = forward(_whole_input(x, device_mesh, sequence))
            return _summed(out, device_mesh, sequence)

        module.forward = split_forward
        return module


def split_experts(moe: DispatchesExperts, mesh: DeviceMesh, reader: PartialReaders) -> list[Slot]:
    """Shard `moe`'s routed and shared experts over `mesh` (every rank built the same whole weights; each keeps its
    slice, no communication); b2 replicated, added by the first rank, read through `reader` by the experts' own
    forward. Returns the slots the block's forward reads locally (the shared experts')."""
    size, experts, slots = mesh.size(), moe.experts, []
    for name, dim in ROUTED_SPLIT.items():
        if getattr(experts, name, None) is not None:
            _check_divides(getattr(experts, name).shape[dim], size, "the routed experts' intermediate size")
            _shard(experts, name, mesh, dim)
    if getattr(experts, "b2", None) is not None:
        if not is_dtensor(experts.b2):  # under expert parallel: sharded over "ep", whole over "tp" already
            whole = DTensor.from_local(experts.b2.data, mesh, [Replicate()], run_check=False)
            experts.b2 = nn.Parameter(whole, requires_grad=experts.b2.requires_grad)
        experts.b2_share = 1.0 if mesh.get_local_rank() == 0 else 0.0
        read_locally(experts, [(experts, "b2")], reader)
    shared = getattr(moe, "shared_experts", None)
    if shared is not None:
        for name, dim in SHARED_SPLIT.items():
            linear = getattr(shared, name)
            _check_divides(linear.weight.shape[dim], size, "the shared experts' intermediate size")
            _shard(linear, "weight", mesh, dim)
            slots.append((linear, "weight"))
    return slots


def read_locally(module: nn.Module, slots: list[Slot], reader: PartialReaders) -> None:
    """`module`'s forward reads `slots` as local tensors (`local_views`). Its own forward, not the block's: under
    expert parallel the experts are an FSDP2 unit of their own, whose parameters FSDP2 puts in place (unsharded) just
    before that forward runs."""
    forward = module.forward

    @functools.wraps(forward)
    def local_forward(*args, **kwargs):
        with local_views(slots, reader):
            return forward(*args, **kwargs)

    module.forward = local_forward


def _check_divides(width: int, size: int, what: str) -> None:
    if width % size:
        raise ConfigError(
            f"parallel.tensor.size={size} with parallel.expert.no_tp=False splits {what} ({width}) over the tensor "
            "ranks: it must divide it; set parallel.expert.no_tp=True (experts whole on every tensor rank)"
        )


@torch.no_grad()
def _shard(module: nn.Module, name: str, mesh: DeviceMesh, dim: int) -> None:
    """`module.name` sharded on `dim` over `mesh`; each rank cuts its part of the whole tensor it built. Under expert
    parallel a routed expert weight is a DTensor over ("ep", "tp") already, whole over "tp": its "tp" placement
    becomes Shard(dim) (a local cut, no communication)."""
    param = getattr(module, name)
    if is_dtensor(param):
        names = param.device_mesh.mesh_dim_names or ()
        placements = [Shard(dim) if axis == "tp" else p for axis, p in zip(names, param.placements)]
        sharded = param.data.redistribute(placements=placements)
    else:
        sharded = distribute_tensor(param.data, mesh, [Shard(dim)], src_data_rank=None)
    setattr(module, name, nn.Parameter(sharded, requires_grad=param.requires_grad))


@contextlib.contextmanager
def local_views(slots: list[Slot], reader: PartialReaders) -> Iterator[None]:
    """The DTensor parameters in `slots` seen as their local tensors during a forward, restored after: a shard's
    gradient is its own; one whole over "tp" (b2, which only the first rank adds: its gradients are each rank's part)
    is read through `reader`, so its gradient is summed over the tensor group before it reaches the parameter, the
    same on every tensor rank, as its layout says (a `Partial` gradient placement would leave that sum to the
    wrapper, which FSDP2 does not make over a 2-D ("ep", "tp") DTensor)."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for sub, name in slots:
            param = sub._parameters[name]
            if not is_dtensor(param):
                continue
            swapped.append((sub, name, param))
            local = param.to_local()
            # the slots' DTensors are sharded over "tp" but for b2, replicated over it (and sharded over "ep")
            whole_over_tensor = any(p.is_replicate() for p in param.placements)
            # a plain tensor in the slot for this forward only (module.__setattr__ takes Parameters alone)
            sub._parameters[name] = reader(local) if whole_over_tensor else local
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
