class MemoryFeature:
    """A memory feature of a run (an activation offloader, an optimizer's offload): figures and teardown."""

    def metrics(self) -> dict[str, float]:  # figures for metrics.jsonl, keys already prefixed
        return {}

    def close(self) -> None:  # idempotent teardown
        pass
