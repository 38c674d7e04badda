"""Tensor-parallel pieces of one parameter merged into the full tensor, and the full tensor split back out.

A writer that splits a parameter over N ranks gives each a contiguous piece along one dim (torch.chunk);
which dim depends on the layer, the parallel mode and the writer's options (InternEvo splits its embedding
along the hidden dim or the vocabulary). The merge needs none of that: it is read off the pieces' shapes
against the parameter's full shape.
"""

import torch

from internlm_offload.errors import CheckpointError


def merge_pieces(pieces: list[torch.Tensor], full: torch.Size, where: str) -> torch.Tensor:
    """The full tensor from its pieces in rank order: replicas (each of the full shape) give the first; pieces
    that are smaller along exactly one dim are concatenated along it. `where` names them in errors."""
    shapes = [tuple(p.shape) for p in pieces]
    if all(shape == tuple(full) for shape in shapes):
        return pieces[0]
    dim = split_dim(shapes, tuple(full))
    if dim is None:
        described = shapes[0] if len(set(shapes)) == 1 else shapes
        raise CheckpointError(
            f"{where}: {len(pieces)} piece(s) of shape {described} do not make the model's {tuple(full)} "
            "(neither copies of it nor a split along one dim)"
        )
    return torch.cat(pieces, dim=dim)


def split_dim(shapes: list[tuple[int, ...]], full: tuple[int, ...]) -> int | None:
    """The one dim along which pieces of these shapes concatenate to `full`, or None."""
    if any(len(shape) != len(full) for shape in shapes):
        return None
    for dim in range(len(full)):
        others_match = all(shape[:dim] + shape[dim + 1 :] == full[:dim] + full[dim + 1 :] for shape in shapes)
        if others_match and sum(shape[dim] for shape in shapes) == full[dim] and len(shapes) > 1:
            return dim
    return None


def split_even(tensor: torch.Tensor, parts: int, dim: int, name: str) -> list[torch.Tensor]:
    """`parts` equal contiguous pieces along `dim` (what column/row-parallel layers hold); refuses uneven ones."""
    if tensor.shape[dim] % parts:
        raise CheckpointError(f"{name}: {tensor.shape[dim]} along dim {dim} does not split into {parts} equal pieces")
    return [piece.contiguous() for piece in torch.chunk(tensor, parts, dim=dim)]
