"""Activation memory: per-layer plan, activation checkpointing (and, with the offload issue, host offload)."""

from internlm_offload.offload.checkpointing import apply_activation_checkpointing
from internlm_offload.offload.plan import LayerMode, LayerPlan, make_layer_plan

__all__ = ["apply_activation_checkpointing", "LayerMode", "LayerPlan", "make_layer_plan"]
