"""Linear warmup, then a decay to `eta_min` (cosine, linear) or none (constant), as a LambdaLR factor."""

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from internlm_offload.errors import CheckpointError

DECAYS = ("cosine", "linear", "constant")
# The entries of a LambdaLR state dict that hold one value per optimizer param group.
_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas")


class WarmupDecay:
    """lr(step) / base_lr: linear from 0 over `warmup_steps`, then from 1 to `eta_min / base_lr` along `decay`
    (`cosine`: half a cosine; `linear`: a straight line; `constant`: stays at 1).

    A plain object (not a closure) so LambdaLR saves and restores it in its state_dict.
    """

    def __init__(
        self, *, base_lr: float, warmup_steps: int, total_steps: int, eta_min: float, decay: str = "cosine"
    ) -> None:
        if decay not in DECAYS:
            raise ValueError(f"lr_scheduler.type={decay!r}: one of {', '.join(DECAYS)}")
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_ratio = eta_min / base_lr
        self.decay = decay

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.decay == "cosine" else 1.0 - progress
        return self.min_ratio + (1.0 - self.min_ratio) * remaining


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    base_lr: float,
    warmup_ratio: float,
    total_steps: int,
    eta_min: float,
    decay: str = "cosine",
) -> LambdaLR:
    warmup_steps = int(warmup_ratio * total_steps)
    schedule = WarmupDecay(
        base_lr=base_lr, warmup_steps=warmup_steps, total_steps=total_steps, eta_min=eta_min, decay=decay
    )
    return LambdaLR(optimizer, schedule)


def load_scheduler_state(scheduler: LambdaLR, state: dict[str, Any]) -> None:
    """Load a saved scheduler state into `scheduler`, whose optimizer may have another number of param groups.

    A checkpoint moving between layouts meets that: expert parallel gives its expert shards groups of their own
    (`param_groups`: one per DTensor mesh). Every group follows the one schedule, so one group's entries stand for
    all of them; saved groups that differ cannot be mapped and raise `CheckpointError`.
    """
    groups = len(scheduler.optimizer.param_groups)
    state = dict(state)
    for key in _PER_GROUP:
        values = state.get(key)
        if values is None or len(values) == groups:
            continue
        if any(value != values[0] for value in values):
            raise CheckpointError(
                f"lr scheduler state: {len(values)} param groups with different {key} saved, {groups} here; "
                "resume on the layout that saved it"
            )
        state[key] = [values[0]] * groups
    scheduler.load_state_dict(state)
