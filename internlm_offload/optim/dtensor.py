"""DTensor helpers for the offloading optimizers: FSDP2 params are DTensors; host copies hold local shards.

One definition of "is a DTensor" (an isinstance check against torch's DTensor, absent in torch builds
without distributed), of a local shard, of wrapping a shard back into a param's layout (what DCP
needs to reshard optimizer states), and of the bytes a rank holds.
"""

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


def laid_out_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`local` as the shard of a DTensor with `like`'s mesh, placements and global shape (an alias); plain if plain."""
    if not is_dtensor(like):
        return local
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def local_nbytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds: a DTensor counts its local shard."""
    local = local_shard(tensor)
    return local.numel() * local.element_size()
