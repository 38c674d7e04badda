"""Per-expert token counts of a mixture-of-experts model in metrics.jsonl: how balanced the routers are."""

import torch
from torch import nn

from internlm_offload.features import MemoryFeature
from internlm_offload.model.moe import MoE


class ExpertLoad(MemoryFeature):
    """Reads the tokens each expert computed during a step (this rank's, all micro-batches, after GShard's capacity).

    The counts stay on the device while the step runs; `metrics` copies them to the host once per step, after
    the step's own sync (a few hundred numbers: no measurable cost).
    """

    def __init__(self, layers: nn.ModuleList) -> None:
        self.moes = [module for module in layers.modules() if isinstance(module, MoE)]

    def metrics(self) -> dict[str, float | list[float]]:
        """`moe_tokens_per_expert`: summed over the sparse blocks; `moe_max_load`: the busiest expert's tokens over
        the mean, in the most unbalanced block (1.0: perfectly balanced)."""
        loads = [moe.take_load() for moe in self.moes]
        if not loads or any(load is None for load in loads):
            return {}
        per_block = torch.stack(loads)  # (blocks, E)
        ratio = (per_block.amax(-1) / per_block.mean(-1).clamp(min=1e-9)).amax()
        values = torch.cat([per_block.sum(0), ratio[None]]).tolist()
        return {"moe_tokens_per_expert": values[:-1], "moe_max_load": values[-1]}
