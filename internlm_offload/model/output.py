"""What every model's forward returns: the logits, its auxiliary losses by name, none of them weighted, and the
logits of its multi-token-prediction depths.

A loss's coefficient is the engine's (engine/loss.py `weighted_aux_losses`, from the config), not the model's: a
model computes the losses, the trainer decides what each weighs in the objective and logs each as `<name>_loss`.
Multi-token prediction's cross-entropies are the engine's too (engine/loss.py `mtp_loss_sums`), logged as `mtp_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

# The router load-balancing loss of a mixture of experts (InternEvo's per layer or transformers' global one).
MOE_AUX = "moe_aux"
# The multi-token-prediction loss's name in the metrics (`mtp_loss`), beside the auxiliary losses.
MTP = "mtp"


@dataclass(frozen=True)
class ModelOutput:
    """Logits (B, T, V) and the auxiliary losses (scalars, unweighted) by name; a dense model's dict is empty.
    `mtp_logits`: depth k's logits (B, T, V) predicting the token k + 1 ahead (model/mtp.py), in training; empty for a
    model without multi-token prediction."""

    logits: torch.Tensor
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    mtp_logits: tuple[torch.Tensor, ...] = ()


# A pytree node, so that what walks a module's outputs (DDP's and FSDP2's backward hooks, FSDP2's output cast)
# reaches the tensors inside rather than taking the output for one opaque leaf.
pytree.register_dataclass(ModelOutput)
