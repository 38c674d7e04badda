"""Selective checkpointing with the kept outputs on the host: bitwise, and the matmuls are not rerun."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from op_counter import OpCounter
from stream_gates import held_back

from internlm_offload.device import Accelerator
from internlm_offload.model import InternLM2
from internlm_offload.offload.activation import offload_layers
from internlm_offload.offload import selective_offload
from internlm_offload.offload.selective_offload import apply_selective_offload

L = 4
CPU = Accelerator("cpu")


def tiny_model() -> InternLM2:
    torch.manual_seed(0)
    return InternLM2(num_layers=L, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=259)


def step(model: nn.Module, micro_num: int = 1):
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(micro_num):
        tokens = torch.randint(0, 259, (2, 33), generator=g)
        loss = F.cross_entropy(model(tokens[:, :-1]).logits.flatten(0, 1), tokens[:, 1:].flatten()) / micro_num
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(got, expected) -> None:
    assert torch.equal(got[0], expected[0])
    for name, grad in expected[1].items():
        assert torch.equal(got[1][name], grad), name


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("micro_num", [1, 4])
def test_bitwise_against_no_checkpointing(mode, micro_num):
    # (retain_graph=True is not covered: torch's composable checkpoint itself refuses a second recompute)
    model = tiny_model()
    handle = apply_selective_offload(model.layers, [0, 1, 2], accelerator=CPU, mode=mode)
    assert_same(step(model, micro_num), step(tiny_model(), micro_num))
    assert handle.metrics()["sc_offload_offloaded_bytes"] > 0 and handle.metrics()["sc_offload_h2d_s"] > 0


def test_combined_with_activation_offload_of_earlier_blocks():
    model = tiny_model()
    apply_selective_offload(model.layers, [1, 2], accelerator=CPU, mode="async")
    handle = offload_layers(model.layers, 1, mode="async", accelerator=CPU)
    assert_same(step(model, 2), step(tiny_model(), 2))
    assert handle.metrics()["act_offload_offloaded_bytes"] > 0


def test_expensive_ops_are_replayed_not_rerun():
    plain, offloaded = tiny_model(), tiny_model()
    apply_selective_offload(offloaded.layers, range(L), accelerator=CPU, mode="sync")
    with OpCounter() as plain_ops:
        step(plain)
    with OpCounter() as offloaded_ops:
        step(offloaded)
    assert offloaded_ops.expensive == plain_ops.expensive  # matmuls and attention ran once
    assert offloaded_ops.cheap > plain_ops.cheap  # norms, activations, RoPE were recomputed


class MutatesMatmulOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w
        y.mul_(2)  # in place on a recorded output: the host copy would be stale
        return y.relu()


def test_in_place_change_of_a_recorded_output_is_refused():
    layers = nn.ModuleList([MutatesMatmulOutput(), nn.Identity()])
    apply_selective_offload(layers, [0], accelerator=CPU, mode="sync")
    with pytest.raises(RuntimeError, match="modified in place"):
        layers[0](torch.randn(4, 8, requires_grad=True))


def test_no_host_memory_is_allocated_after_the_first_step(monkeypatch):
    model = tiny_model()
    handle = apply_selective_offload(model.layers, [0, 1, 2], accelerator=CPU, mode="async")
    step(model)
    calls = []
    host_empty = Accelerator.host_empty
    monkeypatch.setattr(Accelerator, "host_empty", lambda self, *a, **k: calls.append(a) or host_empty(self, *a, **k))
    step(model)
    step(model)
    assert calls == [] and handle.metrics()["sc_offload_host_bytes"] > 0


def _delayed(handle, delay_s: float):
    for lane in (handle.copies.d2h_lane, handle.copies.h2d_lane):
        lane.stream.close()
        lane.stream = CPU.stream(delay_s=delay_s)  # injected copy latency


def test_slow_copies_stay_bitwise_and_dropping_the_load_wait_is_caught():
    model = tiny_model()
    handle = apply_selective_offload(model.layers, [0, 1, 2], accelerator=CPU, mode="async")
    _delayed(handle, 0.01)
    expected = step(tiny_model())
    assert_same(step(model), expected)
    load = handle.load

    def load_without_wait(cache):
        cache.loaded = None  # the bug: replay before the copies back landed
        return load(cache)

    handle.load = load_without_wait
    _delayed(handle, 0.0)
    gate = held_back(handle.copies.h2d)  # the copies back certainly land after the replay (the wait would time out)
    model.zero_grad(set_to_none=True)
    got = step(model)
    gate.set()
    handle.copies.h2d.synchronize()
    assert not all(torch.equal(got[1][name], grad) for name, grad in expected[1].items())


def test_backward_prefetches_the_next_block_and_forward_releases_one_block_late():
    model = tiny_model()
    handle = apply_selective_offload(model.layers, [0, 1, 2], accelerator=CPU, mode="async")
    started_before_replay, released_at_forward_end = [], []
    begin, release = handle.begin_replay, handle._release

    def spy_begin(cache):
        started_before_replay.append(cache.load_started)
        begin(cache)

    def spy_release(cache):
        released_at_forward_end.append(cache is handle._unreleased)
        release(cache)

    handle.begin_replay, handle._release = spy_begin, spy_release
    step(model)
    assert started_before_replay == [False, True, True]  # block 2 first; 1 and 0 were prefetched
    assert released_at_forward_end and all(released_at_forward_end)  # always the previous block's outputs


def test_async_selective_offload_never_blocks_the_host_inside_hooks(monkeypatch):
    """On a device every wait in forward and backward must be a stream wait: count the host waits."""
    from fake_device import fake_accelerator

    acc, host_waits = fake_accelerator(monkeypatch)
    model = tiny_model()
    handle = apply_selective_offload(model.layers, [0, 1, 2], accelerator=acc, mode="async")
    for _ in range(2):
        step(model)
    assert handle.metrics()["sc_offload_host_bytes"] > 0
    assert host_waits == {}
    load = handle.load
    handle.load = lambda cache: handle.copies.h2d.synchronize() or load(cache)
    step(model)  # control: a host wait in a hook is counted
    assert host_waits["stream.synchronize"] > 0


@torch.library.custom_op("internlm_offload_test::scale_and_width", mutates_args=())
def scale_and_width(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """An expensive op with a non-tensor output, as cuda's flash attention (its sequence lengths) has."""
    return x @ w, x.shape[-1]


def _scale_and_width_backward(ctx, grad: torch.Tensor, _width: object) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = ctx.saved_tensors
    return grad @ w.T, x.T @ grad


def _save_inputs(ctx, inputs: tuple, output: object) -> None:
    ctx.save_for_backward(*inputs)


torch.library.register_autograd(
    "internlm_offload_test::scale_and_width", _scale_and_width_backward, setup_context=_save_inputs
)


class UsesWidth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, width = scale_and_width(x, self.w)
        return (y / width).relu()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_non_tensor_outputs_of_expensive_ops_are_replayed_as_they_were(monkeypatch, mode):
    """The replay hands back an expensive op's ints too (None in their place breaks the recompute)."""
    op = torch.ops.internlm_offload_test.scale_and_width.default
    monkeypatch.setattr(selective_offload, "expensive_ops", lambda: frozenset({op}))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    grads = []
    for offload in (False, True):
        layers = nn.ModuleList([UsesWidth(), nn.Identity()])
        if offload:
            apply_selective_offload(layers, [0], accelerator=CPU, mode=mode)
        inp = x.clone().requires_grad_()
        layers[0](inp).sum().backward()
        grads.append((inp.grad, layers[0].w.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
