"""A pipeline stage's auxiliary losses (a mixture of experts' load-balancing loss): backpropagated on the stage that
computes them, logged summed over the stages.

Without a pipeline the trainer adds each micro-batch's weighted auxiliary losses to its objective. Under a pipeline
the objective (the token loss) exists on the last stage only, and each stage's sparse blocks live on their own
stage. So each stage weighs its own blocks' losses as the trainer would (coefficient, then the step's aux weight)
and hangs them on its hidden state after its last block (`AuxLossThroughStage`, Megatron's MoEAuxLossAutoScaler's
idea): forward returns the hidden state unchanged (a copy); backward passes the hidden state's gradient through
unchanged and seeds the weighted loss with gradient 1, as the objective's sum seeds each of its terms. Each router
parameter then takes the gradient it takes in one process, in the same accumulation order (the loss's graph is built
after the stage's blocks in both, and the autograd engine runs later-built nodes first), so the stages' gradients are
one process's bit for bit (tests/unit/test_pipeline_moe.py).

The logged value of each loss is the sum over micro-batches and then over stages (the trainer's reduction over the
pipeline group): one process sums the blocks' losses first, so the two agree within float rounding (a few ulps).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from internlm_offload.engine.loss import weighted_aux_losses
from internlm_offload.model.decoder import AuxLossFn
from internlm_offload.model.router import RouterStats


class AuxLossThroughStage(torch.autograd.Function):
    """`hidden` unchanged; in backward also the gradient 1 of the scalar `objective` (module docstring)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, objective: torch.Tensor) -> torch.Tensor:
        ctx.objective = (objective.shape, objective.dtype, objective.device)
        # A copy (exact, transient: the block's output it copies is saved by no backward), not `hidden` itself:
        # autograd would return an input as a view of it, and the stage's output must be no view (torch's
        # zero-bubble input pass detaches it in place, which views refuse).
        return hidden.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.objective
        return grad_hidden, torch.ones(shape, dtype=dtype, device=device)


def carry_aux_loss(hidden: torch.Tensor, objective: torch.Tensor) -> torch.Tensor:
    """`hidden`, whose backward also backpropagates `objective` (a scalar)."""
    return AuxLossThroughStage.apply(hidden, objective)


class StageAuxLosses:
    """One stage's auxiliary losses: weighed and carried into backward on its hidden state (`attach`), their
    coefficient-weighted values summed over the step's micro-batches for the log (`take`).

    `losses`: the family's function of the stage's router statistics (`Decoder.stage_aux_losses`); `coefficients`:
    each loss's weight by name (what the trainer weighs them by), the names every stage logs. `weight`: the step's
    aux weight (the fp16 loss scale over the micro-batches), set before each step.
    """

    def __init__(self, losses: AuxLossFn, coefficients: Mapping[str, float]) -> None:
        self.losses = losses
        self.coefficients = dict(coefficients)
        self.weight = 1.0
        self._sums: dict[str, torch.Tensor] = {}

    def attach(self, hidden: torch.Tensor, stats: list[RouterStats]) -> torch.Tensor:
        """`hidden` carrying the weighted losses of one micro-batch's `stats` (unchanged for a stage without any)."""
        if not stats or not self.coefficients:  # no sparse block here, or a model without auxiliary losses
            return hidden
        weighted = weighted_aux_losses(self.losses(stats), self.coefficients)
        missing = sorted(self.coefficients.keys() - weighted.keys())
        if missing:  # a family that returns losses but no stage share of them would train without them
            raise RuntimeError(f"a pipeline stage's sparse blocks gave no auxiliary losses {missing}")
        objective = None
        for name, loss in weighted.items():
            self._sums[name] = self._sums[name] + loss.detach() if name in self._sums else loss.detach()
            term = loss * self.weight  # the trainer's term of the objective
            objective = term if objective is None else objective + term
        return carry_aux_loss(hidden, objective)

    def take(self) -> dict[str, torch.Tensor]:
        """Each loss's coefficient-weighted sum over the micro-batches since the last call (absent where none ran),
        and reset."""
        sums, self._sums = self._sums, {}
        return sums
