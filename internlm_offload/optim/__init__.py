"""Optimizers and LR schedules: AdamW, Muon, the swap optimizer, the hybrid CPU/device optimizer."""

from internlm_offload.optim.adamw import AdamW, param_groups
from internlm_offload.optim.hybrid import HybridDeviceOptimizer
from internlm_offload.optim.interface import OffloadOptimizer
from internlm_offload.optim.lr_scheduler import WarmupDecay, build_lr_scheduler
from internlm_offload.optim.muon import Muon
from internlm_offload.optim.swap import SwapAdamW

__all__ = [
    "AdamW",
    "HybridDeviceOptimizer",
    "Muon",
    "OffloadOptimizer",
    "SwapAdamW",
    "WarmupDecay",
    "build_lr_scheduler",
    "param_groups",
]
