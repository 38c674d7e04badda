"""Unit tests for `CopyLane`: the copy recipe (wait for the producer, copy, keep alive, event) on the cpu backend."""

import pytest
import torch

from internlm_offload.device import Accelerator, CopyLane, OrderingError, StreamError


@pytest.fixture
def acc() -> Accelerator:
    accelerator = Accelerator("cpu")
    yield accelerator
    accelerator.close_streams()


def test_a_copy_waits_for_the_compute_stream_by_default(acc: Accelerator) -> None:
    lane, src, dst = CopyLane(acc), torch.zeros(64), torch.empty(64)
    with acc.check_ordering():
        src.add_(1.0)  # compute writes the source just before the copy
        done = lane.copy(dst, src)
        done.synchronize()
    assert torch.equal(dst, torch.ones(64))


def test_a_copy_after_a_stale_event_is_refused(acc: Accelerator) -> None:
    """`after=` an event recorded before compute's last write: the lane waits for that point only."""
    lane, src, dst = CopyLane(acc), torch.zeros(64), torch.empty(64)
    with acc.check_ordering():
        stale = acc.current_stream().record_event()
        src.add_(1.0)
        with pytest.raises(OrderingError, match="make it wait for the compute stream"):
            lane.copy(dst, src, after=stale)


def _copy_of_a_dropped_source(lane: CopyLane, dst: torch.Tensor, keep: bool) -> None:
    src = torch.full((1000,), 3.0)
    lane.copy(dst, src, keep_alive=[src] if keep else [])


def test_keep_alive_holds_a_dropped_source_until_the_copy_ran(acc: Accelerator) -> None:
    lane, dst = CopyLane(acc, delay_s=0.02), torch.empty(1000)
    _copy_of_a_dropped_source(lane, dst, keep=True)
    lane.stream.synchronize()
    assert torch.equal(dst, torch.full((1000,), 3.0))


def test_without_keep_alive_a_dropped_source_is_caught(acc: Accelerator) -> None:
    lane, dst = CopyLane(acc, delay_s=0.02), torch.empty(1000)
    _copy_of_a_dropped_source(lane, dst, keep=False)
    with pytest.raises(StreamError, match="freed by the program before the stream used it"):
        lane.stream.synchronize()


def test_pairs_copy_as_one_task_and_are_timed_on_the_stream(acc: Accelerator) -> None:
    lane = CopyLane(acc)
    srcs = [torch.randn(1 << 20), torch.randn(7)]
    dsts = [torch.empty_like(t) for t in srcs]
    lane.copy(dsts, srcs).synchronize()
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert 0.0 < lane.seconds() < 5.0


def test_a_synchronous_lane_copies_at_once(acc: Accelerator) -> None:
    lane, src, dst = CopyLane(acc, asynchronous=False), torch.randn(1 << 20), torch.empty(1 << 20)
    assert lane.stream is None and lane.copy(dst, src) is None
    assert torch.equal(dst, src) and lane.seconds() > 0.0
