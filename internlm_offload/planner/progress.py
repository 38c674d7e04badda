"""The search's progress on stderr: settings traced and candidates tried out of all, the best fit so far."""

from __future__ import annotations

import sys

from tqdm import tqdm


class SearchProgress:
    """A tqdm bar on stderr while enabled (`tools/plan` enables it on a terminal unless `--no-progress`)."""

    def __init__(self, enabled: bool) -> None:
        self._bar = tqdm(total=0, desc="plan", unit="candidate", file=sys.stderr, disable=not enabled, leave=False)
        self._best: tuple[float, str] | None = None

    def add(self, total: int) -> None:
        """More steps to take (a tensor mode's settings and candidates)."""
        self._bar.total += total
        self._bar.refresh()

    def advance(self, steps: int = 1) -> None:
        self._bar.update(steps)

    def found(self, name: str, step_s: float) -> None:
        """A candidate that fits (each tensor mode's choice): the fastest so far is shown."""
        if self._best is None or step_s < self._best[0]:
            self._best = (step_s, name)
            self._bar.set_postfix_str(f"best fit: {name} ({step_s:.4g} s)")

    def close(self) -> None:
        self._bar.close()
