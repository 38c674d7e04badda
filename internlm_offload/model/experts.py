"""Stacked SwiGLU experts: one parameter per projection over all experts, computed as torch's grouped GEMM.

Each expert e is w2[e](silu(w1[e] x) * w3[e] x), with w1, w3: (E, I, H) and w2: (E, H, I), the nn.Linear (out,
in) layout per expert as transformers 5.x holds its fused experts (InternEvo's grouped files are (E, in, out):
a converter transposes). One tensor per projection lets sharding, offload and the grouped matmul see one tensor.

Options (GPT-OSS): `bias` adds b1, b3: (E, I) and b2: (E, H), each expert's own; `activation` "clamped_swiglu"
is GPT-OSS's (up + 1) * g * sigmoid(alpha * g) with g = min(gate, limit) and up clamped to [-limit, limit]
(`ClampedSwiGLU`).
"""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from internlm_offload.device.kernels import grouped_mm_aligned, has_grouped_mm
from internlm_offload.model.mlp import ParamInit, normal_init
from internlm_offload.offload.hosted_base import Hostable
from internlm_offload.optim.dtensor import local_shard


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient.

    The grouped GEMM's backward rejects an expanded or strided incoming gradient ("Invalid strides/sizes",
    torch 2.13; `y.sum().backward()` produces one): the expert outputs pass through this so whatever loss
    follows, the kernel sees dense rows.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows offs[e-1]:offs[e] of x (N, in) times weight[e].T, for weight (E, out, in): one grouped GEMM."""
    # weight.transpose is a view (E, in, out) with strides (out*in, 1, in): column-major per expert, which the
    # kernel takes as it is (both layouts are allowed; 16-byte strides checked by the caller).
    return _ContiguousGrad.apply(F.grouped_mm(x, weight.transpose(-2, -1), offs=offs))


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's expert activation: gate clamped from above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the experts' default activation."""
    return F.silu(gate) * up


def _row_bias(bias: torch.Tensor, ends: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows, width): expert e's bias (E, width) on each of its rows (rows offs[e-1]:offs[e]; rows past the last
    offset take the last expert's, which the caller masks). A one-hot matmul, not a gather: its backward is a GEMM,
    deterministic on every device (a gather's index_add is not), and no host sync."""
    experts = torch.searchsorted(ends, torch.arange(rows, device=ends.device), right=True)
    one_hot = F.one_hot(experts.clamp(max=bias.shape[0] - 1), bias.shape[0]).to(bias.dtype)
    return one_hot @ bias


class GroupedExperts(nn.Module, Hostable):
    """E SwiGLU experts of width I over tokens already sorted by expert; frozen, they can be held on the host.
    `bias` and `activation` (a `ClampedSwiGLU`; None: silu(gate) * up) are GPT-OSS's options."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        activation: ClampedSwiGLU | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.activation = swiglu if activation is None else activation
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))  # gate
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))  # up
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))  # down
        self.b1 = nn.Parameter(torch.empty(num_experts, intermediate_size)) if bias else None
        self.b3 = nn.Parameter(torch.empty(num_experts, intermediate_size)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
        # what this rank adds of b2: 1, or with the experts split over the tensor group (each rank's output a part of
        # a sum) 1 on the first tensor rank and 0 on the others, so the sum holds it once and every rank's b2 still
        # gets a gradient to sum (engine/expert_tensor_parallel.py)
        self.b2_share = 1.0

    def _biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """This rank's b1, b3, b2 (None without biases): the local experts' under expert parallel, this tensor
        rank's slice of b1 and b3 and its share of b2 with the experts split over the tensor group."""
        b1, b3, b2 = (None if b is None else local_shard(b) for b in (self.b1, self.b3, self.b2))
        return b1, b3, b2 if b2 is None or self.b2_share == 1.0 else b2 * self.b2_share

    def uses_grouped_mm(self, x: torch.Tensor) -> bool:
        """The grouped GEMM where the device has it for this dtype and every row stride is 16-byte aligned;
        else the loop over contiguous slices."""
        intermediate, hidden = local_shard(self.w1).shape[1:]  # this rank's slice of I with the tensor split
        return has_grouped_mm(x.device, x.dtype) and grouped_mm_aligned(x.dtype, hidden, intermediate)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, all_routed: bool = False) -> torch.Tensor:
        """x (N, H): rows grouped by expert, counts[e] rows for expert e (sum(counts) <= N); (N, H) out.

        Rows past sum(counts) (choices GShard dropped) come out as 0, and no gradient flows into them.
        `all_routed`: the caller knows sum(counts) == N (nothing dropped), so there is nothing to mask.
        """
        ends = counts.long().cumsum(0)
        if all_routed:  # the masks below would select every row: two copies forward, two more backward
            return self._compute(x, counts, ends)
        valid = (torch.arange(x.shape[0], device=x.device) < ends[-1])[:, None]
        # The kernel leaves rows past the last offset unwritten, in its output and in the input's gradient:
        # `where` masks both (a multiply would let a NaN from uninitialised memory through).
        x = torch.where(valid, x, 0)
        return torch.where(valid, self._compute(x, counts, ends), 0)

    def _compute(self, x: torch.Tensor, counts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """The experts on every row up to ends[-1]; rows past it are garbage (grouped GEMM) or 0 (loop)."""
        # this rank's experts: the local shard under expert parallel (a DTensor over "ep"), else all
        return self.compute_with(x, counts, ends, local_shard(self.w1), local_shard(self.w3), local_shard(self.w2))

    def compute_with(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        ends: torch.Tensor,
        w1: torch.Tensor,
        w3: torch.Tensor,
        w2: torch.Tensor,
    ) -> torch.Tensor:
        """`_compute` with these weights (the local experts' w1, w3, w2; their biases are the module's own, which
        stay on the device when the weights are hosted)."""
        b1, b3, b2 = self._biases()
        act = self.activation
        if self.uses_grouped_mm(x):
            offs = ends.to(torch.int32)  # stays on the device: no host sync
            gate, up = _grouped_linear(x, w1, offs), _grouped_linear(x, w3, offs)
            if b1 is not None:
                gate, up = gate + _row_bias(b1, ends, x.shape[0]), up + _row_bias(b3, ends, x.shape[0])
            out = _grouped_linear(act(gate, up), w2, offs)
            return out if b2 is None else out + _row_bias(b2, ends, x.shape[0])
        if x.device.type == "meta":
            return self._shapes_only(x, w1, w3, w2)
        return self._loop(x, counts, w1, w3, w2)

    def _shapes_only(self, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """Meta tensors (the planner's trace) have no counts to slice by: every row through expert 0, which makes
        the tensors the grouped path makes, of the same shapes (rows x width activations, whole weight grads)."""
        b1, b3, b2 = (None if b is None else b[0] for b in self._biases())
        return F.linear(self.activation(F.linear(x, w1[0], b1), F.linear(x, w3[0], b3)), w2[0], b2)

    def _loop(
        self, x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
    ) -> torch.Tensor:
        """Expert by expert over contiguous slices: for devices without the grouped GEMM."""
        # The one host sync of the routing path: slicing needs the counts as Python ints.
        sizes = counts.long().tolist()
        b1, b3, b2 = self._biases()
        outs, start = [], 0
        for e, size in enumerate(sizes):
            xe = x[start : start + size]
            gate = F.linear(xe, w1[e], None if b1 is None else b1[e])
            up = F.linear(xe, w3[e], None if b3 is None else b3[e])
            outs.append(F.linear(self.activation(gate, up), w2[e], None if b2 is None else b2[e]))
            start += size
        outs.append(x.new_zeros(x.shape[0] - start, x.shape[1]))  # dropped rows
        return torch.cat(outs)

    def param_inits(self, std: float, out_std: float) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        """normal(0, std) for w1, w3; normal(0, out_std) for w2, which writes into the residual stream; biases (if
        any) zero, as transformers draws GPT-OSS's."""
        yield self.w1, normal_init(std)
        yield self.w3, normal_init(std)
        yield self.w2, normal_init(out_std)
        for bias in (self.b1, self.b3, self.b2):
            if bias is not None:
                yield bias, nn.init.zeros_

    @staticmethod
    def host_tensor_names() -> list[str]:
        """What `model.lora.base_on_host` holds on the host and brings in (offload/hosted_base.py), in order."""
        return ["w1", "w3", "w2"]

    @staticmethod
    def hosted_class() -> type["GroupedExperts"]:
        return HostedGroupedExperts


class HostedGroupedExperts(GroupedExperts):
    """Frozen experts held on the host (`model.lora.base_on_host`): the stacked projections come in for forward and
    again for backward (`hosted.weights`), nothing of them saved. Backward recomputes the experts on the saved rows
    with the weights brought in again and differentiates that, so the input's gradient is `GroupedExperts`' own,
    bit for bit, for one more expert forward a step."""

    def _compute(self, x: torch.Tensor, counts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        return _HostedExperts.apply(x, counts, ends, self)


class _HostedExperts(torch.autograd.Function):
    """`GroupedExperts.compute_with` on the device copies of the weights, fetched again for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counts: torch.Tensor, ends: torch.Tensor, module: HostedGroupedExperts):
        ctx.module = module
        ctx.save_for_backward(x, counts, ends)
        return module.compute_with(x, counts, ends, *module.hosted.weights(module))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        x, counts, ends = ctx.saved_tensors
        weights = ctx.module.hosted.weights(ctx.module)
        with torch.enable_grad():
            rows = x.detach().requires_grad_()
            out = ctx.module.compute_with(rows, counts, ends, *weights)
        (grad_rows,) = torch.autograd.grad(out, rows, grad)
        return grad_rows, None, None, None
