"""The interface every feature of a run shares: figures for metrics.jsonl, per-step work, and teardown."""


class MemoryFeature:
    """A feature of a run (an activation offloader, an optimizer's offload, a router monitor): figures and teardown."""

    def after_backward(self) -> None:
        """Once per step, after every micro-batch's backward and the gradient reduction, before clipping and the
        optimizer step (the router bias update)."""
        pass

    def metrics(self) -> dict[str, float]:
        """Figures for metrics.jsonl, keys already prefixed."""
        return {}

    def close(self) -> None:
        """Idempotent teardown."""
        pass
