"""mtp / msp / fsp on a mixture of experts with InternEvo's `parallel.expert.no_tp=True`: each sparse block whole on
every rank of the tensor group, each rank routing its own chunk of the sequence.

What it may touch: a sparse block's `feed_forward` (the `MoE`): its parameters that are not already DTensors (the
router, the shared experts and their coefficient, and the routed experts without expert parallel) become replicated
DTensors over "tp", and its forward runs on this rank's chunk. The attention and the dense blocks' MLPs keep the
column/row plan of engine/tensor_parallel.py.

The rule, from the data flow:

- msp / fsp: the block input between the column and row regions is sequence-sharded already (Shard(1)), so each
  tensor rank routes the tokens of its own chunk with whole experts, as isp's ranks do; nothing is gathered, and
  fsp's gather-again has nothing to gather in a sparse block.
- mtp: the input is replicated over the tensor group. Routing it whole on every rank would run every expert on
  every token T times; the block instead takes this rank's chunk of the sequence (a slice, no communication) and
  all-gathers the outputs (whose backward keeps this rank's chunk of the gradient, again no communication). That
  is InternEvo's way too: under mtp with no_tp it splits the MoE input on the sequence over the tensor group and
  gathers the output (`MoESequenceParallelCommunicator(reverse=True)`), its expert tensor group of size 1.
- Gradients: every rank's whole weights see only its chunk's tokens, so their gradients are the chunk's part; each
  local weight is the `to_local` of a replicated DTensor with a `Partial` gradient placement, so the gradient is
  summed over "tp" where the tensor plan's sums run (`align_grads_in_backward`, or FSDP2's redistribution before its
  reduce-scatter over "dp"), as for sequence-parallel norms. Experts under expert parallel are DTensors of the
  expert mesh, carved from every rank with "ep" innermost (engine/runtime.py): their expert-data group spans the
  tensor ranks, so its sum adds the chunks.
- Aux loss: each rank's is its chunk's (GShard's capacity too, from the chunk's tokens). InternEvo averages it over
  the tensor group; here each rank's aux term is weighted by 1/T (`TrainerSettings.aux_chunks`), so the summed
  gradients are those of the chunks' mean, and the logged value, averaged over every rank, is that mean. It is not
  the whole sequence's loss of one process (a mean of per-chunk products), as under isp.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from internlm_offload.optim.dtensor import is_dtensor


class WholeMoE(ParallelStyle):
    """A sparse block's `MoE` whole on every tensor rank, routing this rank's sequence chunk (module docstring).
    `sequence_sharded`: msp/fsp, whose input arrives as the chunk; mtp's replicated input is sliced and the
    outputs all-gathered."""

    def __init__(self, sequence_sharded: bool) -> None:
        super().__init__()
        self.sequence_sharded = sequence_sharded

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        slots = replicate_parameters(module, device_mesh)
        forward = module.forward
        sharded = self.sequence_sharded

        @functools.wraps(forward)
        def chunk_forward(x: torch.Tensor) -> torch.Tensor:
            with local_parameters(slots, device_mesh):
                if sharded:  # msp/fsp: this rank's chunk, the residual stream's layout between the blocks
                    return forward(x.to_local() if is_dtensor(x) else x)
                chunk = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                out = forward(chunk.redistribute(placements=[Shard(1)]).to_local())
                return DTensor.from_local(out, device_mesh, [Shard(1)], run_check=False).full_tensor()

        module.forward = chunk_forward
        return module


Slot = tuple[nn.Module, str]  # a parameter's place: its module and its name there


@torch.no_grad()
def replicate_parameters(module: nn.Module, mesh: DeviceMesh) -> list[Slot]:
    """Each parameter of `module` that is a plain tensor becomes a replicated DTensor over `mesh` (every rank built
    the same whole weight; no communication); returns their slots. DTensors (expert parallel's, a style's) stay."""
    slots = []
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            if is_dtensor(param):
                continue
            whole = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
            setattr(sub, name, nn.Parameter(whole, requires_grad=param.requires_grad))
            slots.append((sub, name))
    return slots


@contextlib.contextmanager
def local_parameters(slots: list[Slot], mesh: DeviceMesh) -> Iterator[None]:
    """The replicated DTensor parameters over `mesh` in `slots` (`replicate_parameters`') seen as their local tensors
    during a forward, their gradients `Partial` (each rank's chunk's part, summed over the tensor group later);
    restored after. Only those slots: a replicated DTensor a style made (a whole kv projection's) keeps its own
    gradient rule."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for sub, name in slots:
            param = sub._parameters[name]
            if not is_dtensor(param) or param.device_mesh != mesh or param.placements != (Replicate(),):
                continue
            swapped.append((sub, name, param))
            # a plain tensor in the slot for this forward only (module.__setattr__ takes Parameters alone)
            sub._parameters[name] = param.to_local(grad_placements=[Partial()])
        yield
    finally:
        for sub, name, param in swapped:
            sub._parameters[name] = param
