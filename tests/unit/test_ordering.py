"""Every "copy waits for compute" in the offload paths is needed, and the ordering ledger proves it.

With `Accelerator.check_ordering()` a side-stream task submitted before its stream waited for the compute
work that last touched its memory raises `OrderingError` (see `device.cpu_checks`). Each offload path runs
clean under it; removing the wait for the compute stream of any one of its copy lanes (`device.CopyLane`,
through which every offload path copies) makes it raise.
"""

from collections.abc import Callable
from operator import attrgetter

import pytest
import torch
from stream_gates import held_back

from internlm_offload.device import Accelerator, CopyLane, OrderingError, StreamError
from internlm_offload.offload import offload_layers
from internlm_offload.offload.selective_offload import apply_selective_offload
from internlm_offload.optim.hybrid import HybridDeviceOptimizer
from internlm_offload.optim.swap import SwapAdamW


def _activation_offload(acc: Accelerator) -> tuple[object, Callable[[], None]]:
    from test_activation_offload import step, tiny_model

    model = tiny_model()
    handle = offload_layers(model.layers, 3, mode="async", accelerator=acc)
    return handle, lambda: step(model)


def _selective_offload(acc: Accelerator) -> tuple[object, Callable[[], None]]:
    from test_selective_offload import step, tiny_model

    model = tiny_model()
    handle = apply_selective_offload(model.layers, [0, 1, 2], accelerator=acc, mode="async")
    return handle, lambda: step(model)


def _optimizer_steps(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for _ in range(3):
            sum((p * p).sum() for p in params).backward()  # compute reads the params, writes the grads
            if isinstance(optimizer, SwapAdamW):
                optimizer.prefetch()
            optimizer.step()
            optimizer.zero_grad()

    return run


def _params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen, requires_grad=True) for n in (4097, 300, 1023, 7, 5000)]


def _swap(acc: Accelerator) -> tuple[object, Callable[[], None]]:
    params = _params()
    opt = SwapAdamW(
        params, lr=1e-2, fused=True, swap_optimizer_times=3, use_pinned_optimizer_offload=True, accelerator=acc
    )
    return opt, _optimizer_steps(opt, params)


def _hybrid(acc: Accelerator) -> tuple[object, Callable[[], None]]:
    params = _params()
    opt = HybridDeviceOptimizer(params, offload_fraction=0.5, accelerator=acc, lr=1e-2)
    return opt, _optimizer_steps(opt, params)


# site -> (build the path, the copy lane whose wait is removed: attributes from the path's object)
SITES = {
    "activation offload: D2H waits for the activation": (_activation_offload, "copies.d2h_lane"),
    "activation offload: H2D waits before reusing memory": (_activation_offload, "copies.h2d_lane"),
    "selective offload: D2H waits for the output": (_selective_offload, "copies.d2h_lane"),
    "selective offload: H2D waits before reusing memory": (_selective_offload, "copies.h2d_lane"),
    "swap: copy-in waits for compute's last use of the buffer": (_swap, "_h2d"),
    "swap: copy-out waits for the update": (_swap, "_d2h"),
    "hybrid: grads D2H wait for backward": (_hybrid, "_d2h"),
    "hybrid: params H2D wait for compute's last read": (_hybrid, "_h2d"),
}


@pytest.mark.parametrize(
    "build",
    [_activation_offload, _selective_offload, _swap, _hybrid],
    ids=["activation", "selective", "swap", "hybrid"],
)
def test_offload_paths_are_ordered(build) -> None:
    acc = Accelerator("cpu")
    _, run = build(acc)
    with acc.check_ordering() as ledger:
        run()
    assert ledger.epoch > 0  # the compute ops were seen
    acc.close_streams()


@pytest.mark.parametrize("site", list(SITES))
def test_removing_a_compute_wait_is_caught(site: str, monkeypatch: pytest.MonkeyPatch) -> None:
    build, lane_path = SITES[site]
    acc = Accelerator("cpu")
    owner, run = build(acc)
    lane = attrgetter(lane_path)(owner)
    removed = []
    real_wait_for = CopyLane._wait_for

    def wait_for(self: CopyLane, producer: object) -> None:
        if self is lane:
            removed.append(producer)
            return  # the bug: this wait is gone
        real_wait_for(self, producer)

    monkeypatch.setattr(CopyLane, "_wait_for", wait_for)
    with pytest.raises(OrderingError, match="make it wait for the compute stream"), acc.check_ordering():
        run()
    assert removed, f"{lane_path} made no wait: the site list is stale"
    monkeypatch.undo()
    acc.close_streams()


# path -> (the method that drops the device sources, the attribute holding the event it waits for first)
RELEASES = {
    "activation": (_activation_offload, "_release_sources", "d2h_done"),
    "selective": (_selective_offload, "_release", "copied_out"),
}


@pytest.mark.parametrize("path", list(RELEASES))
def test_releasing_sources_before_their_copies_ran_is_caught(path: str) -> None:
    """Device tensors are their D2H copies' sources: dropped before the copies ran, a device could reuse their
    memory at once. The cpu stream refuses a task whose tensor only the task still holds."""
    build, method, event_attr = RELEASES[path]
    acc = Accelerator("cpu")
    handle, run = build(acc)
    release = getattr(handle, method)

    def release_without_waiting(owner: object) -> None:
        setattr(owner, event_attr, None)  # the bug: the sources go before their copies finished
        release(owner)

    setattr(handle, method, release_without_waiting)
    gate = held_back(handle.copies.d2h)  # the copies certainly run after the sources went
    try:
        with pytest.raises(StreamError, match="freed by the program before the stream used it"):
            run()
            gate.set()
            handle.copies.d2h.synchronize()
    finally:
        gate.set()
        acc.close_streams()
