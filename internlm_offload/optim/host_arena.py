"""A coalesced host arena: one aligned host buffer that holds many tensors as views.

One large (pinned, on accelerators) allocation instead of thousands of small ones: pinning is an
expensive driver call per buffer, and per-tensor pageable copies are slower than pinned ones. The
arena is allocated once, its views are reused across steps, and `release()` frees it explicitly.
"""

import math
from collections.abc import Sequence

import torch

from internlm_offload.device import Accelerator, aligned_within

ALIGNMENT = 512  # bytes; keeps every view aligned for vectorised copies and DMA


class HostArena:
    """Host memory for tensors of the given shapes and dtypes, as views of one buffer."""

    def __init__(
        self,
        accelerator: Accelerator,
        specs: Sequence[tuple[torch.Size | tuple[int, ...], torch.dtype]],
        *,
        pinned: bool = True,
        alignment: int = ALIGNMENT,
    ) -> None:
        if ALIGNMENT % alignment:
            raise ValueError(f"alignment={alignment} must divide {ALIGNMENT}")
        self.offsets, total = aligned_offsets(specs, alignment)
        self.specs = list(specs)
        self.nbytes = _align(total)
        # Offsets are relative to the buffer, so the buffer itself starts aligned.
        raw = accelerator.host_empty((self.nbytes + ALIGNMENT,), torch.uint8, pinned=pinned)
        self.buffer: torch.Tensor | None = aligned_within(raw, self.nbytes, ALIGNMENT)

    def span(self, start: int, nbytes: int) -> torch.Tensor:
        """Bytes `[start, start + nbytes)` of the buffer, as a flat uint8 view."""
        if self.buffer is None:
            raise RuntimeError("HostArena.span after release()")
        return self.buffer[start : start + nbytes]

    def view(self, index: int) -> torch.Tensor:
        """The tensor at slot `index` (uninitialised until written)."""
        if self.buffer is None:
            raise RuntimeError("HostArena.view after release()")
        shape, dtype = self.specs[index]
        start = self.offsets[index]
        nbytes = math.prod(shape) * dtype.itemsize
        return self.buffer[start : start + nbytes].view(dtype).view(shape)

    def release(self) -> None:
        """Free the buffer; views taken earlier keep their memory alive until dropped."""
        self.buffer = None


def aligned_offsets(
    specs: Sequence[tuple[torch.Size | tuple[int, ...], torch.dtype]], alignment: int
) -> tuple[list[int], int]:
    """Byte offsets of tensors packed in order, each starting on a multiple of `alignment`; and the end."""
    offsets, total = [], 0
    for shape, dtype in specs:
        total = _align(total, alignment)
        offsets.append(total)
        total += math.prod(shape) * dtype.itemsize
    return offsets, total


def _align(offset: int, alignment: int = ALIGNMENT) -> int:
    return (offset + alignment - 1) // alignment * alignment
