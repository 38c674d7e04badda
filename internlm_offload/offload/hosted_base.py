"""A frozen LoRA base on the host under `parallel.mode` none / DDP (`model.lora.base_on_host`, docs/lora.md).

Every frozen `nn.Linear` of a decoder block (PEFT's `base_layer`s and the linears no adapter targets) keeps its
weight and bias in host memory (pinned where the accelerator pins): the parameters themselves are the host tensors,
so state dicts, weight loading and export see them as always. Its forward brings the block's frozen linears to the
device a block at a time on a copy lane (`device.CopyLane`, the one recipe of side-stream copies), and backward does
again: the linear is an autograd function that saves no weight, only which module it was, and asks for its device
copy again to compute the input's gradient. Modules that say how to be hosted (`Hostable`: QLoRA's 4-bit linears
with their scales, a mixture of experts' stacked experts) are held and brought the same way and compute with what
`weights` hands them. Visiting block i brings block i + 1 in on the lane (i - 1 going down,
in backward; at the last block, the one below, which backward visits next), so at most two blocks' copies are on the
device and the next block's copy overlaps the current block's compute.

The numbers are the device run's: the same kernels (`F.linear` forward, `grad @ W` for the input's gradient, as
autograd's own backward of a linear whose weight takes no gradient) on the same bytes. Checkpointing's recompute and
activation offload see a linear with no saved weight; the norms' weights, the embedding and the head stay on the
device (small against the blocks' linears, or outside the blocks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from internlm_offload.device import Accelerator, CopyLane, Event, finish_and_close
from internlm_offload.features import MemoryFeature


class Hostable:
    """A frozen module that says how `HostedBase` holds it on the host (model/hooks.py lists it with the model's
    other hooks; it lives here, a floor below the model). A plain frozen `nn.Linear` needs no declaration."""

    hosted: HostedBase  # set by `HostedBase` when it holds this module, which then has the class `hosted_class()`

    def host_tensor_names(self) -> list[str]:
        """What is held on the host and brought in, in order."""
        raise NotImplementedError

    @staticmethod
    def hosted_class() -> type[nn.Module]:
        """The class this module takes when hosted: its forward computes with `hosted.weights(self)`."""
        raise NotImplementedError


class HostedBase(MemoryFeature):
    """The frozen linears of `layers` in host memory, brought to the device a block at a time."""

    def __init__(
        self, layers: nn.ModuleList, accelerator: Accelerator, *, asynchronous: bool = True, placed: bool = False
    ) -> None:
        """`placed`: the frozen linears' tensors are host buffers of `accelerator.host_empty` already (built there
        from meta); otherwise they are copied into new ones."""
        self.accelerator = accelerator
        self.device = accelerator.current_device()
        self.lane = CopyLane(accelerator, asynchronous=asynchronous, non_blocking=accelerator.supports_pinned_memory)
        self.blocks: list[list[nn.Module]] = [frozen_linears(block) for block in layers]
        self._block_of: dict[int, int] = {}
        for index, linears in enumerate(self.blocks):
            for linear in linears:
                self._block_of[id(linear)] = index
                if not placed:
                    self._to_host(linear)
                linear.__class__ = linear.hosted_class() if isinstance(linear, Hostable) else HostedLinear
                linear.hosted = self
        self.host_bytes = sum(
            p.numel() * p.element_size() for ls in self.blocks for lin in ls for p in hosted_tensors(lin)
        )
        # block -> (its linears' device copies in `hosted_tensors` order, the copy's end event; None once waited on)
        self._resident: dict[int, tuple[dict[int, list[torch.Tensor]], Event | None]] = {}
        self._current: int | None = None
        self._blocks_brought = 0
        self._reported = (0.0, 0)  # (copy seconds, blocks brought) at the last `metrics`

    def _to_host(self, linear: nn.Module) -> None:
        for tensor in hosted_tensors(linear):
            host = self.accelerator.host_empty(tensor.shape, tensor.dtype)
            with torch.no_grad():
                host.copy_(tensor)
            # the same tensor objects move (a 4-bit linear's scales too): the masters' copy shares them
            tensor.data = host

    # ------------------------------------------------------------------ bringing blocks in

    def weights(self, linear: nn.Module) -> list[torch.Tensor]:
        """`linear`'s weight (and bias; a 4-bit linear's scales after them, `tensor_names`) on the device, its block brought in and the next one on its way."""
        block = self._block_of[id(linear)]
        if block != self._current:
            self._visit(block)
        copies, event = self._resident[block]
        if event is not None:  # the compute stream waits for the block's copy once, before its first use
            event.wait()
            self._resident[block] = (copies, None)
        return copies[id(linear)]

    def _visit(self, block: int) -> None:
        """Make `block` the current one: keep only it and the one visited next on the device."""
        going_down = self._current is not None and block < self._current
        self._current = block
        if block not in self._resident:
            self._bring(block)
        upcoming = block - 1 if going_down or block == len(self.blocks) - 1 else block + 1
        for other in [b for b in self._resident if b not in (block, upcoming)]:
            # the compute stream's queued kernels on these copies run first; the lane's use was recorded
            del self._resident[other]
        if 0 <= upcoming < len(self.blocks) and upcoming not in self._resident:
            self._bring(upcoming)

    def _bring(self, block: int) -> None:
        """Copy `block`'s frozen linears to fresh device buffers on the lane, after the compute stream's work."""
        srcs = [p for linear in self.blocks[block] for p in hosted_tensors(linear)]
        dsts = [torch.empty(p.shape, dtype=p.dtype, device=self.device) for p in srcs]
        event = self.lane.copy(dsts, [p.detach() for p in srcs], keep_alive=dsts)
        copies, start = {}, 0
        for linear in self.blocks[block]:
            count = len(hosted_tensors(linear))
            copies[id(linear)] = dsts[start : start + count]
            start += count
        self._resident[block] = (copies, event)
        self._blocks_brought += 1

    # ------------------------------------------------------------------ figures and teardown

    def metrics(self) -> dict[str, float]:
        """The base's host bytes; the lane's copy seconds and the blocks brought in since the last call."""
        seconds, brought = self.lane.seconds(), self._blocks_brought
        figures = {
            "base_on_host_bytes": float(self.host_bytes),
            "base_on_host_copy_s": seconds - self._reported[0],
            "base_on_host_blocks": float(brought - self._reported[1]),
        }
        self._reported = (seconds, brought)
        return figures

    def close(self) -> None:
        self._resident.clear()
        finish_and_close(self.lane.stream)


def frozen_linears(block: nn.Module) -> list[nn.Module]:
    """The plain linears of `block` whose weight trains not (a LoRA base layer, an untargeted projection), and
    the frozen modules that say how to be hosted (`Hostable`: QLoRA's 4-bit linears, a mixture of experts' stacked
    experts)."""
    return [
        m
        for m in block.modules()
        if (type(m) is nn.Linear and not m.weight.requires_grad)
        or (isinstance(m, Hostable) and not any(p.requires_grad for p in m.parameters(recurse=False)))
    ]


def tensor_names(linear: nn.Module) -> list[str]:
    """What is held on the host and brought in, in order: weight, bias, then a 4-bit linear's scales."""
    if isinstance(linear, Hostable):
        return linear.host_tensor_names()
    return ["weight"] if linear.bias is None else ["weight", "bias"]


def hosted_tensors(linear: nn.Module) -> list[torch.Tensor]:
    return [getattr(linear, name) for name in tensor_names(linear)]


class HostedLinear(nn.Linear):
    """A frozen linear whose weight lives on the host (`HostedBase`): forward and backward use its device copy."""

    hosted: HostedBase

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _HostedLinearFn.apply(x, self)


class _HostedLinearFn(torch.autograd.Function):
    """`F.linear` with a frozen weight brought in for forward and again for backward; nothing of it saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, linear: HostedLinear) -> torch.Tensor:  # noqa: ANN001
        ctx.linear = linear
        return F.linear(x, *linear.hosted.weights(linear))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        weight = ctx.linear.hosted.weights(ctx.linear)[0]
        return grad.matmul(weight), None
