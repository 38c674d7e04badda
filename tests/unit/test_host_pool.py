"""HostPool: a returned buffer that a copy may still read is handed out again only after that copy."""

import pytest
import torch
from stream_gates import held_back

from internlm_offload.device import Accelerator
from internlm_offload.device import HostPool, PendingCopy


@pytest.mark.parametrize("wait", [True, False], ids=["with_wait", "without_wait"])
def test_a_buffer_still_read_by_a_copy_is_not_reused_early(wait: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    acc = Accelerator("cpu")
    pool = HostPool(acc, pin_memory=False)
    h2d = acc.stream(delay_s=0.05)  # a slow prefetch that backward never consumed
    # Without the wait, the copy is held back until the buffer was handed out and written again.
    gate = held_back(h2d) if not wait else None
    host = pool.take(4096)
    host.fill_(7)
    device = torch.empty(4096, dtype=torch.uint8)
    h2d.wait_stream(acc.current_stream())
    acc.copy_async(device, host, h2d)
    pool.give_back([host], PendingCopy(h2d.record_event()))
    if not wait:  # the bug: hand the buffer out without waiting for its last reader
        monkeypatch.setattr(pool, "free", {n: [(b, None) for b, _ in bucket] for n, bucket in pool.free.items()})
    reused = pool.take(4096)
    assert reused.data_ptr() == host.data_ptr()  # the same buffer comes back
    reused.fill_(1)  # the next offload's copy writes it
    if gate is not None:
        gate.set()
    h2d.synchronize()
    assert torch.equal(device, torch.full_like(device, 7)) is wait
    acc.close_streams()
