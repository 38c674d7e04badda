"""The noaux_tc router bias update (DeepSeek-V3's auxiliary-loss-free balancing, as XTuner trains it), once a step.

Each router's `e_score_correction_bias` only picks experts (their weights come from the unbiased scores). After every
micro-batch's backward and before clipping, the step's top-k choices per expert, counted on every token of every
micro-batch (a transformers model's through its router taps, a native model's by its sparse blocks, never a
forward recomputed in backward), are summed over all ranks (every rank then holds the same counts and applies the
same update: the biases stay replicated with no broadcast), and each bias moves by `speed` against its expert's load
(`model.router.bias_update`). The counts also give XTuner's `maxvio`, logged as `moe_maxvio`. Under a pipeline each
rank counts its own stages' routers in a table of all the model's, zeros in the other rows (model/moe.py
`BiasBlocks`): the same sum gives every rank every router's counts, and each moves the biases it holds.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist

from internlm_offload.features import MemoryFeature
from internlm_offload.model.router import StepChoices, bias_update, max_violation


class RouterBiasUpdate(MemoryFeature):
    """Updates the biases `biases()` (one (E,) fp32 buffer per router, in `choices`' order) from `choices` each step.

    `speed` 0 leaves them as they are and still logs `moe_maxvio`. `group`: the ranks whose tokens the counts pool
    over (None: all, the data-parallel ranks of a model every rank holds whole). `rows`: the rows of `choices`' table
    that `biases()` are, in order (a pipeline rank's own routers among the model's, moe.BiasBlocks; None: all).
    """

    def __init__(
        self,
        biases: Callable[[], list[torch.Tensor]],
        choices: StepChoices,
        speed: float,
        *,
        distributed: bool,
        group: dist.ProcessGroup | None = None,
        rows: list[int] | None = None,
    ) -> None:
        self.biases = biases
        self.choices = choices
        self.speed = speed
        self.distributed = distributed
        self.group = group
        self.rows = rows
        self._maxvio: torch.Tensor | None = None

    @torch.no_grad()
    def after_backward(self) -> None:
        counts = self.choices.take()
        if counts is None:
            return
        if self.distributed:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.group)
        if self.speed > 0:
            held = counts if self.rows is None else counts[self.rows]
            for bias, row in zip(self.biases(), held, strict=True):
                bias.copy_(bias_update(bias, row.to(bias.device), self.speed))
        self._maxvio = max_violation(counts)

    def metrics(self) -> dict[str, float]:
        """`moe_maxvio`: over the routers, the mean of (busiest expert's choices - mean) / mean in the last step
        (read after the step's own sync)."""
        if self._maxvio is None:
            return {}
        value, self._maxvio = float(self._maxvio), None
        return {"moe_maxvio": value}
