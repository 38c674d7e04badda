"""Linear warmup then cosine decay to `eta_min`, as a LambdaLR factor."""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


class WarmupCosine:
    """lr(step) / base_lr: linear from 0 over `warmup_steps`, then cosine from 1 to `eta_min / base_lr`.

    A plain object (not a closure) so LambdaLR saves and restores it in its state_dict.
    """

    def __init__(self, *, base_lr: float, warmup_steps: int, total_steps: int, eta_min: float) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_ratio = eta_min / base_lr

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * cosine


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, *, base_lr: float, warmup_ratio: float, total_steps: int, eta_min: float
) -> LambdaLR:
    warmup_steps = int(warmup_ratio * total_steps)
    schedule = WarmupCosine(base_lr=base_lr, warmup_steps=warmup_steps, total_steps=total_steps, eta_min=eta_min)
    return LambdaLR(optimizer, schedule)
