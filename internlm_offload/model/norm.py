"""RMSNorm, the decoder's norm: computed in float32 and cast back, one weight initialised to ones."""

from collections.abc import Iterator

import torch
from torch import nn

from internlm_offload.model.mlp import ParamInit


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)

    def param_inits(self) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        yield self.weight, nn.init.ones_
