"""RMSNorm, the decoder's norm: computed in float32 and cast back, one weight initialised to ones (or, zero-centred,
to zeros and applied as 1 + w: Qwen3-Next / Qwen3.5)."""

from collections.abc import Iterator

import torch
from torch import nn

from internlm_offload.model.mlp import ParamInit


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float, zero_centred: bool = False) -> None:
        """`zero_centred`: out = rmsnorm(x) * (1 + w) in float32, w initialised to 0 (Qwen3-Next's norms)."""
        super().__init__()
        self.eps = eps
        self.zero_centred = zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centred:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return (h * self.weight.float()).to(x.dtype)

    def param_inits(self) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        yield self.weight, nn.init.zeros_ if self.zero_centred else nn.init.ones_
