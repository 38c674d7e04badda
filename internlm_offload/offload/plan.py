"""Per-layer plan: which decoder blocks are offloaded, checkpointed (full or selective) or left plain.

InternEvo's rule, with `L` blocks, `N = cpu_offloading.num_layers` and `r = model.checkpoint`:
blocks `[0, N)` offload their saved activations (and are not recomputed), blocks `[N, int(L * r))` are
activation-checkpointed (selectively when `selective_checkpoint`), the rest keep their activations.
"""

from dataclasses import dataclass
from enum import Enum


class LayerMode(str, Enum):
    OFFLOAD = "offload"
    CHECKPOINT = "checkpoint"
    SELECTIVE = "selective"
    SELECTIVE_OFFLOAD = "selective+offload"
    PLAIN = "plain"


@dataclass(frozen=True)
class LayerPlan:
    modes: tuple[LayerMode, ...]

    def layers_with(self, *modes: LayerMode) -> list[int]:
        return [i for i, mode in enumerate(self.modes) if mode in modes]

    def table(self) -> str:
        """A two-column text table (layer → mode) for the run log."""
        rows = [f"  layer {i:>3}  {mode.value}" for i, mode in enumerate(self.modes)]
        return "\n".join(["  layer      mode", *rows])


def make_layer_plan(
    num_layers: int,
    *,
    offload_layers: int = 0,
    checkpoint_ratio: float = 0.0,
    selective: bool = False,
    selective_offload: bool = False,
) -> LayerPlan:
    """Resolve the per-block plan; errors name the config key that is out of range."""
    if not 0 <= offload_layers < num_layers:
        raise ValueError(f"cpu_offloading.num_layers={offload_layers} must be in [0, {num_layers})")
    if not 0.0 <= checkpoint_ratio <= 1.0:
        raise ValueError(f"model.checkpoint={checkpoint_ratio} must be in [0, 1]")
    if selective_offload and not selective:
        raise ValueError("selective_checkpoint_offload=True needs selective_checkpoint=True")
    checkpointed_end = int(num_layers * checkpoint_ratio)
    if selective:
        recompute = LayerMode.SELECTIVE_OFFLOAD if selective_offload else LayerMode.SELECTIVE
    else:
        recompute = LayerMode.CHECKPOINT
    modes = []
    for i in range(num_layers):
        if i < offload_layers:
            modes.append(LayerMode.OFFLOAD)
        elif i < checkpointed_end:
            modes.append(recompute)
        else:
            modes.append(LayerMode.PLAIN)
    return LayerPlan(tuple(modes))
