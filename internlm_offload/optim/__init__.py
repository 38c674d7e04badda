"""Optimizers and LR schedules: AdamW, the swap optimizer (host-resident states) and its host arena."""

from internlm_offload.optim.adamw import build_adamw, param_groups
from internlm_offload.optim.host_arena import HostArena
from internlm_offload.optim.lr_scheduler import WarmupCosine, build_lr_scheduler
from internlm_offload.optim.swap import SwapAdamW, build_swap_adamw

__all__ = ["build_adamw", "build_swap_adamw", "param_groups", "HostArena", "SwapAdamW", "WarmupCosine",
           "build_lr_scheduler"]
