"""Muon's matrix step over a DTensor parameter (FSDP2, tensor and expert parallel): each logical matrix whole.

Newton-Schulz of a shard is not Newton-Schulz of the matrix (muon.md trip-wire 3), so the update, computed
elementwise on the local shards, is gathered whole before it is orthogonalised:
- a stack `[E, out, in]` sharded on its expert dim only (expert parallel, FSDP2 over whole experts) holds whole
  experts on every rank: each is orthogonalised where it is, with no communication (XTuner's "local" path);
- any other layout: every rank all-gathers the update in Newton-Schulz's dtype (bf16 by default: Newton-Schulz
  casts to it first, so the gathered bits are the ones one process orthogonalises, at half the bytes of fp32; fp32
  under `ns_dtype="torch.float32"`, or the update's own dtype where that is narrower), orthogonalises each logical
  matrix whole and applies the part it holds (Megatron's "duplicated" mode: one all-gather of 2 bytes per element per
  step, and W ranks each run every Newton-Schulz; an owner-per-matrix all-to-all would divide that work by W).
The lr ratio is the logical matrix's, from the global shape.
"""

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

Orthogonalise = Callable[[torch.Tensor], torch.Tensor]
Scale = Callable[[torch.Size], float]  # the adjusted lr of a matrix of this shape


def experts_whole_here(param: DTensor) -> bool:
    """A stack sharded on its expert dim alone (or replicated): this rank's shard holds whole experts."""
    return param.ndim == 3 and all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0)
                                   for p in param.placements)  # fmt: skip


def sharded_matrix_step(
    param: DTensor,
    update: DTensor,
    blocks: Callable[[torch.Size], list[tuple]],
    orthogonalise: Orthogonalise,
    scale: Scale,
    decay: float,
    ns_dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Decay `param` by `decay` and add each logical matrix's orthogonalised `update` (`blocks(shape)` indexes
    them) times `-scale(block shape)`, on this rank's part of `param`; `ns_dtype`: the dtype `orthogonalise`
    casts to first."""
    local = param.to_local()
    if experts_whole_here(param):
        local_update = update.to_local()
        local.mul_(decay)
        for index in blocks(local.shape):
            block = orthogonalise(local_update[index])
            local[index].add_(block, alpha=-scale(block.shape))
        return
    # the same collective on every rank, in the params' order; the cast first (a narrower update is not widened)
    wire = ns_dtype if ns_dtype.itemsize < update.dtype.itemsize else update.dtype
    whole = update.to(wire).full_tensor()
    with torch.device("cpu"):  # its offsets are a host tensor it reads: not on the planner's default meta device
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local.mul_(decay)
    for index in blocks(param.shape):
        block = orthogonalise(whole[index])
        mine = _overlap(index, param.shape, shape, offset)
        if mine is not None:
            here, there = mine
            local[here].add_(block[there], alpha=-scale(block.shape))


def _overlap(
    index: tuple, global_shape: torch.Size, local_shape: tuple[int, ...], offset: tuple[int, ...]
) -> tuple[tuple, tuple] | None:
    """(index into the local shard, index into the block) of the part of block `index` this rank holds, or None.
    `index` is an int per leading (expert) dim, then a row slice; the block drops the int dims."""
    ranges = [(i, i + 1) if isinstance(i, int) else (i.start, i.stop) for i in index]
    ranges += [(0, global_shape[d]) for d in range(len(index), len(global_shape))]
    here, there = [], []
    for dim, (start, stop) in enumerate(ranges):
        low, high = max(start, offset[dim]), min(stop, offset[dim] + local_shape[dim])
        if low >= high:
            return None
        if dim < len(index) and isinstance(index[dim], int):
            here.append(low - offset[dim])  # an expert: gone from the block
        else:
            here.append(slice(low - offset[dim], high - offset[dim]))
            there.append(slice(low - start, high - start))
    return tuple(here), tuple(there)
