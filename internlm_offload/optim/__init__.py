"""Optimizers and LR schedules (the offloading optimizers arrive with the optimizer-offload issue)."""

from internlm_offload.optim.adamw import build_adamw, param_groups
from internlm_offload.optim.lr_scheduler import WarmupCosine, build_lr_scheduler

__all__ = ["build_adamw", "param_groups", "WarmupCosine", "build_lr_scheduler"]
