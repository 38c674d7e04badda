"""Deterministic races on the cpu streams: hold a side stream's work until the test lets it go."""

import threading

from internlm_offload.device import Stream


def held_back(stream: Stream, timeout_s: float = 10.0) -> threading.Event:
    """Hold every task queued on `stream` after this call until the returned event is set (or the timeout):
    a copy that has certainly not landed while the caller runs on, however the machine schedules threads."""
    gate = threading.Event()
    stream.submit(gate.wait, timeout_s)
    return gate
