"""The interface every memory feature of a run shares: figures for metrics.jsonl, and teardown."""


class MemoryFeature:
    """A memory feature of a run (an activation offloader, an optimizer's offload): figures and teardown."""

    def metrics(self) -> dict[str, float]:
        """Figures for metrics.jsonl, keys already prefixed."""
        return {}

    def close(self) -> None:
        """Idempotent teardown."""
        pass
