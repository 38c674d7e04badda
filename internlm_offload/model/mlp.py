"""The SwiGLU feed-forward (dense blocks, shared experts) and the weight-init helpers the decoder's modules share."""

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Fills one whole parameter in place, drawing from the torch RNG where it is random.
ParamInit = Callable[[torch.Tensor], Any]


def normal_init(std: float) -> ParamInit:
    """normal(0, std) in place."""
    return functools.partial(nn.init.normal_, mean=0.0, std=std)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def param_inits(self, std: float, out_std: float) -> Iterator[tuple[nn.Parameter, ParamInit]]:
        """normal(0, std) for w1, w3; normal(0, out_std) for w2, which writes into the residual stream."""
        yield self.w1.weight, normal_init(std)
        yield self.w3.weight, normal_init(std)
        yield self.w2.weight, normal_init(out_std)
