"""The language-model loss: summed token cross-entropy, computed in row chunks; a model's auxiliary losses weighted;
multi-token prediction's labels (`mtp_labels`).

`F.cross_entropy(logits.float(), ...)` over a whole micro-batch holds its fp32 temporaries for every
token at once: the upcast logits, the log-softmax autograd saves for backward, and in backward the fp32
gradient beside its cast back to the logits' dtype; at 7B (4096 tokens x 92544 classes) each is 1.4 GiB.
Here forward keeps only the logits and labels, and backward computes the gradient one chunk of rows at a
time (`CHUNK_BYTES` of fp32) straight into one buffer of the logits' dtype. Each chunk runs the same
kernels on the same rows as the whole-batch loss (cross-entropy is row-wise), so the gradients are
bitwise those of `F.cross_entropy`; the loss value is summed in another order (its last bits may
differ). The price: backward recomputes the chunk's log-softmax.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from internlm_offload.model.mtp import roll_in_documents
from internlm_offload.optim.dtensor import is_dtensor

CHUNK_BYTES = 256 * 2**20  # fp32 logits of one chunk
IGNORE = -100  # a label that carries no loss


def token_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, *, label_smoothing: float = 0.0, chunk_bytes: int = CHUNK_BYTES
) -> torch.Tensor:
    """Summed fp32 cross-entropy of (..., V) `logits` against `labels` (-100: no loss), in row chunks."""
    rows, labels = logits.reshape(-1, logits.size(-1)), labels.reshape(-1)
    per_chunk = max(1, chunk_bytes // (rows.size(-1) * 4))
    # Vocab-sharded logits (tensor parallel's `loss_parallel`): torch's sharded cross-entropy over the whole
    # micro-batch; each rank's fp32 temporaries are 1/T of the vocabulary's.
    if rows.size(0) <= per_chunk or is_dtensor(rows):
        return _loss_sum(rows, labels, label_smoothing)
    return _ChunkedCrossEntropy.apply(rows, labels, label_smoothing, per_chunk)


def _loss_sum(rows: torch.Tensor, labels: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return F.cross_entropy(rows.float(), labels, reduction="sum", label_smoothing=label_smoothing)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """`_loss_sum` whose backward recomputes it chunk by chunk; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, labels: torch.Tensor, label_smoothing: float, per_chunk: int):
        ctx.save_for_backward(rows, labels)
        ctx.label_smoothing, ctx.per_chunk = label_smoothing, per_chunk
        losses = [_loss_sum(r, y, label_smoothing) for r, y in zip(rows.split(per_chunk), labels.split(per_chunk))]
        return torch.stack(losses).sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor):
        rows, labels = ctx.saved_tensors
        grad = torch.empty_like(rows)
        for start in range(0, rows.size(0), ctx.per_chunk):
            chunk = slice(start, start + ctx.per_chunk)
            with torch.enable_grad():
                upcast = rows[chunk].detach().float().requires_grad_()
                loss = _loss_sum(upcast, labels[chunk], ctx.label_smoothing)  # `.float()` of fp32 is itself
                (chunk_grad,) = torch.autograd.grad(loss, upcast, grad_loss)
            grad[chunk].copy_(chunk_grad)  # the cast back to the logits' dtype, as `.float()`'s backward does
        return grad, None, None, None


def weighted_aux_losses(
    aux_losses: Mapping[str, torch.Tensor], coefficients: Mapping[str, float]
) -> dict[str, torch.Tensor]:
    """Each auxiliary loss of a `ModelOutput` times its coefficient, in fp32, by name: what the objective adds."""
    unknown = sorted(aux_losses.keys() - coefficients.keys())
    if unknown:
        raise ValueError(
            f"the model returned auxiliary losses {unknown} with no coefficient (known: {sorted(coefficients)})"
        )
    # the coefficient's product before the fp32 cast: the order in which the models weighed their losses themselves
    return {name: (coefficients[name] * loss).float() for name, loss in aux_losses.items()}


def mtp_labels(labels: torch.Tensor, position_ids: torch.Tensor | None, depth: int) -> list[torch.Tensor]:
    """Multi-token prediction's labels of depths 1..`depth`: depth k's are `labels` (B, T; already the next token's)
    moved left by k inside each packed document, -100 past its end: at position t, the token t + k + 1."""
    return [roll_in_documents(labels, k, position_ids, IGNORE) for k in range(1, depth + 1)]


def mtp_token_counts(micro_batches: list, depth: int) -> list[int]:
    """Each depth's labelled tokens over a rank's micro-batches ((input_ids, labels[, position_ids]) each), at least 1:
    what depth k's loss sums are divided by, as the language model's by its own count."""
    counts = [0] * depth
    for micro_batch in micro_batches:
        positions = micro_batch[2] if len(micro_batch) > 2 else None
        for k, rolled in enumerate(mtp_labels(micro_batch[1], positions, depth)):
            counts[k] += int((rolled != IGNORE).sum())
    return [max(1, count) for count in counts]
