"""What a run asks of any optimizer, whether or not it offloads: no-op defaults, so callers never probe."""

from collections.abc import Callable
from typing import Any

import torch

from internlm_offload.features import MemoryFeature


def evaluate_closure(closure: Callable[[], Any] | None) -> Any:
    """torch's `step(closure)` contract: re-evaluate the loss with gradients on, before the step reads them."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class OffloadOptimizer(MemoryFeature):
    """Mixin for the run's optimizers (AdamW, SwapAdamW, HybridDeviceOptimizer); put it before the torch base.

    The defaults describe an optimizer whose states stay on the device: nothing to prefetch, wait for or
    move, no figures. The method names are InternEvo's, which users of optimizer offload know.
    """

    def prefetch(self) -> None:
        """Start moving what `step()` reads first; the trainer calls it when the last backward begins."""

    def finish_copies(self) -> None:
        """Wait for copies `step()` left in flight; readers of host-resident values (checkpoints) call it."""

    def offload_optimizer_states(self) -> bool:
        """Move the device optimizer states to host memory between phases; returns whether anything moved."""
        return False

    def reload_optimizer_states(self) -> bool:
        """Bring offloaded states back where `step()` expects them; returns whether anything moved."""
        return False

    def memory_stats(self) -> dict[str, int]:
        """Byte counts of the optimizer's offload (none when every state stays on the device)."""
        return {}

    def metrics(self) -> dict[str, float]:
        """`memory_stats()` as metrics.jsonl's `optim_*` fields."""
        return {f"optim_{key}": value for key, value in self.memory_stats().items()}
