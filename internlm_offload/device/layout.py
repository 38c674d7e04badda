"""Byte layout of flat buffers: the page size, rounding up to an alignment, tensors at aligned offsets.

The host slabs (`host_buffers.HostArena`), the swap optimizer's chunk buffers, gradient offload's staging
buffers and the NVMe tier's files all hold many tensors as views of one flat uint8 buffer; they lay them
out with these functions.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

PAGE_BYTES = mmap.PAGESIZE  # the kernel's page: what mappings, registration and madvise work in

TensorSpec = tuple[torch.Size | tuple[int, ...], torch.dtype]


def round_up(nbytes: int, alignment: int) -> int:
    """`nbytes` rounded up to a multiple of `alignment`."""
    return -(-nbytes // alignment) * alignment


def aligned_offsets(specs: Sequence[TensorSpec], alignment: int) -> tuple[list[int], int]:
    """Byte offsets of tensors packed in order, each starting on a multiple of `alignment`; and the end."""
    offsets, total = [], 0
    for shape, dtype in specs:
        total = round_up(total, alignment)
        offsets.append(total)
        total += math.prod(shape) * dtype.itemsize
    return offsets, total


def view_at(buffer: torch.Tensor, offset: int, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The `shape` x `dtype` tensor at byte `offset` of the flat uint8 `buffer`."""
    return buffer[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


def aligned_views(buffer: torch.Tensor, specs: Sequence[TensorSpec], alignment: int) -> list[torch.Tensor]:
    """The tensors of `specs` as views of `buffer`, at the offsets `aligned_offsets` gives them."""
    offsets, _ = aligned_offsets(specs, alignment)
    return [view_at(buffer, offset, shape, dtype) for offset, (shape, dtype) in zip(offsets, specs)]


def aligned_within(raw: torch.Tensor, nbytes: int, alignment: int) -> torch.Tensor:
    """The first `nbytes` of the flat uint8 `raw` that start on a multiple of `alignment` (allocate
    `nbytes + alignment` for them): plain allocations only promise 64-byte alignment."""
    start = -raw.data_ptr() % alignment
    return raw[start : start + nbytes]
