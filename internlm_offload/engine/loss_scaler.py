"""fp16 dynamic loss scaling with InternEvo's `grad_scaler` semantics.

The loss is multiplied by `scale` before backward so that small fp16 gradients do not underflow; the
gradients are multiplied by `1 / scale` before clipping. A step whose gradients overflow (non-finite
norm) is skipped. On overflow the growth counter resets and, once `hysteresis` overflows have been
seen since the last growth, every further overflow multiplies the scale by `backoff_factor` (never
below `min_scale`). After `growth_interval` consecutive good steps the scale is multiplied by
`growth_factor` (never above `max_scale`) and the overflow count resets.

torch's `GradScaler` has no hysteresis, minimum or maximum scale, so it cannot reproduce InternEvo's
schedule; this is the small state machine that does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicLossScaler:
    scale: float = 2.0**16
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    growth_step: int = 0
    hysteresis_step: int = 0

    def update(self, overflow: bool) -> None:
        """Advance the schedule after a step (`overflow`: its gradients were not finite)."""
        if overflow:
            self.growth_step = 0
            self.hysteresis_step += 1
            if self.hysteresis_step >= self.hysteresis:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_step += 1
        if self.growth_step == self.growth_interval:
            self.growth_step = 0
            self.hysteresis_step = 0
            self.scale = min(self.scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict[str, float | int]:
        """The position in the schedule; the schedule's settings come from the config."""
        return {key: getattr(self, key) for key in _DYNAMIC}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        for key in _DYNAMIC:
            setattr(self, key, state[key])


_DYNAMIC = ("scale", "growth_step", "hysteresis_step")
