"""Graceful stops: SIGTERM (what SLURM and Kubernetes send before preemption) and Ctrl-C.

The first SIGTERM or SIGINT only sets a flag: the trainer finishes the step it is in, writes a
checkpoint and returns, so `--resume` continues the curve bitwise. A second SIGINT raises
`KeyboardInterrupt` at once (the launcher exits 130 without a traceback). Under torchrun every rank
gets the signal, maybe at different steps: the trainer agrees on the stop step through the step's
loss all-reduce.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from internlm_offload.log import get_logger

logger = get_logger(__name__)

HANDLED = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """A context manager that turns the first SIGTERM/SIGINT into a stop request (`requested`)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for signum in HANDLED:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt
        if self.requested:
            return
        self.signal_name = signal.Signals(signum).name
        again = " (Ctrl-C again to exit at once, without a checkpoint)" if signum == signal.SIGINT else ""
        logger.warning("%s received: finishing this step, then checkpoint and stop%s", self.signal_name, again)
