"""Activation memory: the per-layer plan, activation checkpointing (full and selective), host offload of
saved activations (`offload_layers`) and selective checkpointing with host-offloaded outputs."""

from internlm_offload.offload.activation import ActivationOffloader, offload_layers
from internlm_offload.offload.apply import apply_layer_plan
from internlm_offload.offload.checkpointing import apply_activation_checkpointing
from internlm_offload.offload.plan import LayerMode, LayerPlan, make_layer_plan
from internlm_offload.offload.selective_offload import apply_selective_offload

__all__ = [
    "apply_activation_checkpointing",
    "apply_layer_plan",
    "apply_selective_offload",
    "offload_layers",
    "ActivationOffloader",
    "LayerMode",
    "LayerPlan",
    "make_layer_plan",
]
