"""The chunked token loss: gradients bitwise those of one cross-entropy, a fraction of its fp32 temporaries."""

import pytest
import torch
import torch.nn.functional as F

from internlm_offload.engine.loss import token_loss_sum
from internlm_offload.planner.tracker import StorageTracker

CHUNK = 64 * 1000 * 4  # 64 rows of 1000 classes in fp32: 4096 rows make 64 chunks


def logits_and_labels(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 2048, 1000, generator=gen) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 1000, (2, 2048), generator=gen)
    labels[:, ::7] = -100  # no loss there
    return logits, labels


def plain(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", label_smoothing=label_smoothing
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_chunked_gradients_are_bitwise_and_the_loss_agrees(dtype, label_smoothing):
    logits, labels = logits_and_labels(dtype)
    expected = plain(logits, labels, label_smoothing)
    (expected * 0.37).backward()
    expected_grad, logits.grad = logits.grad, None
    got = token_loss_sum(logits, labels, label_smoothing=label_smoothing, chunk_bytes=CHUNK)
    (got * 0.37).backward()
    assert torch.equal(logits.grad, expected_grad)
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)  # summed in another order
    with torch.no_grad():
        assert token_loss_sum(logits, labels, label_smoothing=label_smoothing, chunk_bytes=CHUNK).item() == (
            pytest.approx(expected.item(), rel=1e-5)
        )


def test_one_chunk_is_the_plain_loss_bit_for_bit():
    logits, labels = logits_and_labels(torch.float32)
    assert torch.equal(token_loss_sum(logits, labels), plain(logits, labels, 0.0))


@pytest.mark.parametrize(
    "dtype, plain_at_least, chunked_below", [(torch.float32, 2.9, 2.25), (torch.bfloat16, 2.9, 1.25)]
)
def test_chunks_hold_one_chunks_fp32_temporaries(dtype, plain_at_least, chunked_below):
    """Peak bytes of a head's logits through the loss's forward and backward, as the trainer runs it, in units
    of the fp32 logits (4096 x 1000, 16 MB): the plain loss holds several fp32 copies of them, the chunked
    one the logits, their gradient and one chunk's temporaries."""

    def peak(loss_fn) -> int:
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(2, 2048, 16, generator=gen).to(dtype).requires_grad_()
        head = torch.randn(16, 1000, generator=gen).to(dtype).requires_grad_()
        labels = torch.randint(0, 1000, (2, 2048), generator=gen)
        tracker = StorageTracker()
        with tracker:
            loss_fn(hidden @ head, labels).backward()
        return tracker.peak_bytes("device")

    fp32_logits = 4096 * 1000 * 4
    plain_peak = peak(lambda x, y: plain(x, y, 0.0)) / fp32_logits
    chunked_peak = peak(lambda x, y: token_loss_sum(x, y, chunk_bytes=CHUNK)) / fp32_logits
    assert plain_peak >= plain_at_least and chunked_peak < chunked_below, (plain_peak, chunked_peak)
