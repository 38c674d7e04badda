"""DTensor helpers for the offloading optimizers: FSDP2 params are DTensors; host copies hold local shards.

One definition of "is a DTensor" (an isinstance check against torch's DTensor, absent in torch builds
without distributed), of a local shard, of wrapping a shard back into a param's layout (what DCP
needs to reshard optimizer states, and what activation offload rebuilds a saved DTensor from), and of
the bytes a rank holds.
"""

from dataclasses import dataclass
from typing import Any

import torch

try:
    from torch.distributed.tensor import DTensor

    DTENSOR_TYPES: tuple[type, ...] = (DTensor,)
except ImportError:  # torch built without distributed: no DTensor params to meet
    DTENSOR_TYPES = ()


def is_dtensor(tensor: object) -> bool:
    return isinstance(tensor, DTENSOR_TYPES)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (an alias of its storage), or the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


@dataclass(frozen=True)
class Layout:
    """Where a DTensor's shard sits: its mesh, placements, global shape and stride (no data)."""

    mesh: Any
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]


def layout_of(tensor: torch.Tensor) -> Layout:
    """The layout of a DTensor, to wrap a shard into it later without keeping the DTensor alive."""
    return Layout(tensor.device_mesh, tuple(tensor.placements), tensor.shape, tensor.stride())


def with_layout(local: torch.Tensor, layout: Layout) -> torch.Tensor:
    """`local` as the shard of a DTensor of `layout` (an alias)."""
    return DTensor.from_local(
        local, layout.mesh, layout.placements, run_check=False, shape=layout.shape, stride=layout.stride
    )


def laid_out_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`local` as the shard of a DTensor with `like`'s mesh, placements and global shape (an alias); plain if plain."""
    return with_layout(local, layout_of(like)) if is_dtensor(like) else local


def local_nbytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds: a DTensor counts its local shard."""
    local = local_shard(tensor)
    return local.numel() * local.element_size()
