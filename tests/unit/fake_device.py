"""A fake accelerator for host-sync accounting: streams and events that do nothing but count host waits.

Tensors stay on the cpu; `torch.fakedev` stands in for `torch.cuda`. Work "submitted" to a fake
stream runs at once on the host (as a device stream's enqueue does), so what is counted is exactly
where the code would block the host on a device: `Event.synchronize`, `Stream.synchronize` and the
module's `synchronize`.
"""

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from internlm_offload.device import Accelerator


class _Raw:
    """A fake device stream or event: every operation is free, host waits are counted."""

    def __init__(self, counts: Counter, kind: str) -> None:
        self.counts, self.kind = counts, kind

    def record(self, stream: object = None) -> None: ...
    def wait(self, stream: object = None) -> None: ...
    def wait_event(self, event: object) -> None: ...
    def query(self) -> bool:
        return True

    def elapsed_time(self, other: object) -> float:
        return 0.0

    def synchronize(self) -> None:
        self.counts[f"{self.kind}.synchronize"] += 1


def fake_accelerator(monkeypatch: pytest.MonkeyPatch) -> tuple[Accelerator, Counter]:
    """An Accelerator('fakedev') and the counter of host waits it makes."""
    counts: Counter = Counter()

    @contextmanager
    def stream(raw: _Raw) -> Iterator[None]:
        yield

    module = SimpleNamespace(
        Stream=lambda: _Raw(counts, "stream"),
        Event=lambda enable_timing=False: _Raw(counts, "event"),
        current_stream=lambda: _Raw(counts, "current_stream"),
        stream=stream,
        synchronize=lambda: counts.update(["device.synchronize"]),
    )
    monkeypatch.setattr(torch, "fakedev", module, raising=False)
    # cpu tensors cannot be pinned or recorded on a fake stream: plain host memory, no allocator to tell
    monkeypatch.setattr(
        Accelerator, "host_empty", lambda self, shape, dtype, pinned=True: torch.empty(shape, dtype=dtype)
    )
    monkeypatch.setattr(Accelerator, "record_stream", lambda self, tensor, stream: None)
    return Accelerator("fakedev"), counts
