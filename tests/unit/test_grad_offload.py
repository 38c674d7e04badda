"""Gradient offload: host gradients bitwise those of the run without it, and every wait of its schedule needed.

Each race test runs the schedule with one stage slowed down (a delayed copy stream, a held host thread); it
goes red when the wait that orders that stage is removed.
"""

import threading

import pytest
import torch
import torch.nn as nn

from internlm_offload.device import Accelerator, OrderingError
from internlm_offload.engine.precision import MasterWeights, NoMasters
from internlm_offload.model import InternLM2
from internlm_offload.optim.grad_offload import GradOffload

MICRO_BATCHES = 3
SMALL_BUCKET = 4096  # bytes: several buckets per backward, so the two staging buffers are reused


def tiny_model() -> InternLM2:
    torch.manual_seed(0)
    model = InternLM2(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=259)
    model.unused = nn.Parameter(torch.ones(3))  # never gets a gradient
    return model


def micro_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 259, (2, 16), generator=generator) for _ in range(MICRO_BATCHES)]


def backward(model: nn.Module, masters, tokens: torch.Tensor) -> None:
    model(tokens).logits.float().square().mean().backward()
    masters.accumulate_grads()


def masters_for(model: nn.Module, dtype: torch.dtype):
    if dtype == torch.float32:
        return NoMasters(model)
    return MasterWeights(model, dtype)


def reference_grads(dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
    """The stepped parameters' gradients of the run without offload: `.grad` or MasterWeights' fp32 buffer."""
    model = tiny_model()
    masters = masters_for(model, dtype)
    for tokens in micro_batches():
        backward(model, masters, tokens)
    masters.grads()
    stepped = masters.module.named_parameters()
    return {name: None if p.grad is None else p.grad.clone() for name, p in stepped}


def offloaded(dtype: torch.dtype, acc: Accelerator, bucket_bytes: int = SMALL_BUCKET) -> tuple[nn.Module, GradOffload]:
    model = tiny_model()
    masters = masters_for(model, dtype)
    offload = GradOffload(masters, acc, bucket_bytes=bucket_bytes, from_zeros=dtype != torch.float32)
    return model, offload


def host_grads(offload: GradOffload) -> dict[str, torch.Tensor | None]:
    offload.grads()
    records = {id(r.master): r for r in offload.records()}
    stepped = offload.module.named_parameters()
    return {name: records[id(p)].host_grad if id(p) in records else None for name, p in stepped}


def assert_bitwise(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        if grad is None:
            assert got[name] is None, name
        else:
            assert got[name] is not None and torch.equal(got[name], grad), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_gradients_equal_the_run_without_offload_bitwise(dtype):
    acc = Accelerator("cpu")
    model, offload = offloaded(dtype, acc)
    for tokens in micro_batches():
        backward(model, offload, tokens)
        assert all(p.grad is None for p in model.parameters())  # no gradient stays on the device
    got = host_grads(offload)
    assert_bitwise(got, reference_grads(dtype))
    unused = got["unused"]
    assert unused is None if dtype == torch.float32 else torch.equal(unused, torch.zeros(3))
    offload.release_grads()  # the next step starts afresh: one micro-batch's gradients, not two steps'
    backward(model, offload, micro_batches()[0])
    one = tiny_model()
    one_masters = masters_for(one, dtype)
    backward(one, one_masters, micro_batches()[0])
    one_masters.grads()
    assert_bitwise(host_grads(offload), {n: p.grad for n, p in one_masters.module.named_parameters()})
    offload.close()


class SignedZeroGradient(nn.Module):
    """One parameter whose gradient is -0.0 everywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self) -> torch.Tensor:
        return (self.weight.float() * -0.0).sum()


def test_the_first_gradient_is_added_to_zeros_like_the_masters_buffer():
    """A -0.0 gradient: MasterWeights' zeroed buffer holds 0 + -0.0 = +0.0, and so must the host gradient."""
    model = SignedZeroGradient()
    masters = MasterWeights(model, torch.bfloat16)
    offload = GradOffload(masters, Accelerator("cpu"), bucket_bytes=64, from_zeros=True)
    model().backward()
    offload.accumulate_grads()
    grad = host_grads(offload)["weight"]
    assert torch.equal(grad, torch.zeros(8)) and not torch.signbit(grad).any()
    offload.close()


@pytest.mark.parametrize("wait_removed", [False, True])
def test_a_copy_started_before_backward_wrote_the_gradients_is_refused(wait_removed):
    """The copy stream waits for the compute stream before reading a bucket (the ordering ledger)."""
    acc = Accelerator("cpu")
    model, offload = offloaded(torch.bfloat16, acc)
    if wait_removed:
        offload._lane.stream.wait_stream = lambda other: None
    with acc.check_ordering():
        if wait_removed:
            with pytest.raises(OrderingError):
                backward(model, offload, micro_batches()[0])
        else:
            backward(model, offload, micro_batches()[0])
    offload.close()


def test_slow_copies_land_before_they_are_added():
    """A delayed copy stream: the host thread waits for each bucket's copy, `grads()` for every add, and
    the dropped device gradients stay alive until their copy read them (`record_stream`)."""
    acc = Accelerator("cpu")
    model, offload = offloaded(torch.bfloat16, acc)
    offload._lane.stream = acc.stream(delay_s=0.01)
    expected = reference_grads(torch.bfloat16)  # first: its time must not hide a missing wait
    for tokens in micro_batches():
        backward(model, offload, tokens)
    assert_bitwise(host_grads(offload), expected)
    offload.close()


def test_a_staging_buffer_is_reused_only_after_its_bucket_was_added():
    """The host thread held back: backward must wait before copying a third bucket into the first buffer."""
    acc = Accelerator("cpu")
    model, offload = offloaded(torch.bfloat16, acc)
    gate = threading.Event()
    offload._worker.submit(gate.wait, 10.0)
    releaser = threading.Timer(0.3, gate.set)
    releaser.start()
    for tokens in micro_batches():
        backward(model, offload, tokens)
    assert_bitwise(host_grads(offload), reference_grads(torch.bfloat16))
    releaser.join()
    offload.close()


def test_a_gradient_larger_than_the_bucket_travels_alone():
    acc = Accelerator("cpu")
    model, offload = offloaded(torch.bfloat16, acc, bucket_bytes=64)
    for tokens in micro_batches():
        backward(model, offload, tokens)
    assert_bitwise(host_grads(offload), reference_grads(torch.bfloat16))
    assert offload.metrics()["grad_offload_host_bytes"] > 0
    offload.close()
