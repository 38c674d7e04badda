"""What every model's forward returns: the logits and its auxiliary losses by name, none of them weighted.

A loss's coefficient is the engine's (engine/loss.py `weighted_aux_losses`, from the config), not the model's: a
model computes the losses, the trainer decides what each weighs in the objective and logs each as `<name>_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

# The router load-balancing loss of a mixture of experts (InternEvo's per layer or transformers' global one).
MOE_AUX = "moe_aux"


@dataclass(frozen=True)
class ModelOutput:
    """Logits (B, T, V) and the auxiliary losses (scalars, unweighted) by name; a dense model's dict is empty."""

    logits: torch.Tensor
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)


# A pytree node, so that what walks a module's outputs (DDP's and FSDP2's backward hooks, FSDP2's output cast)
# reaches the tensors inside rather than taking the output for one opaque leaf.
pytree.register_dataclass(ModelOutput)
