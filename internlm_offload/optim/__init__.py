"""Optimizers and LR schedules: AdamW, the swap optimizer and its host arena, the hybrid CPU/device optimizer."""

from internlm_offload.optim.adamw import AdamW, build_adamw, param_groups
from internlm_offload.optim.host_arena import HostArena
from internlm_offload.optim.hybrid import HybridDeviceOptimizer, build_hybrid_adamw
from internlm_offload.optim.interface import OffloadOptimizer
from internlm_offload.optim.lr_scheduler import WarmupCosine, build_lr_scheduler
from internlm_offload.optim.swap import SwapAdamW, build_swap_adamw

__all__ = [
    "AdamW",
    "build_adamw",
    "build_hybrid_adamw",
    "build_lr_scheduler",
    "build_swap_adamw",
    "param_groups",
    "HostArena",
    "HybridDeviceOptimizer",
    "OffloadOptimizer",
    "SwapAdamW",
    "WarmupCosine",
]
