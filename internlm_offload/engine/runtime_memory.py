"""The runtime's own device memory, measured once at start-up.

Two parts, neither a tensor of the run, so the planner's trace (meta tensors) sees neither:

- what is in use on the device before the run allocates anything (`Accelerator.device_memory_in_use`):
  on cuda/npu the context and whatever else holds the device; 0 on cpu, whose device memory is the
  host's (what the process already holds is not in the host's available memory either);
- what kernels keep after their first use (`Accelerator.memory_kept_by`): cuBLAS workspaces; on cpu
  oneDNN's and MKL's caches and per-thread buffers (1.8 to 2.6 MiB for the 4-block tiny config, mostly
  tied to the shapes the kernels ran at). `kernel_memory` runs one forward and backward of a one-block
  copy of the model, at the run's micro-batch shape and compute dtype, and returns what stays. Under Muon the
  probe also runs Newton-Schulz once at each shape of the block's Muon matrices (`optimizer_kernels`): its bf16
  matmuls leave oneDNN's caches of ~2 MiB per shape on cpu (5.6 MiB for configs/internlm2_tiny_muon.py, whose
  measured peak read -14.6 % against the trace without it).

`launch` takes the first before the preflight, which adds it to the traced peak where it compares with
the device (the `memory_budget` search fits the peak beside it too), and the second once the preflight
has passed (a config that cannot fit is refused before any kernel runs) and before the builder marks
its memory baseline, so the step readings count the run's tensors as the trace does; the trainer's
memory line names both beside the measured and predicted peaks.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence

import torch
from torch import nn

from internlm_offload.device import Accelerator
from internlm_offload.engine.loss import token_loss_sum
from internlm_offload.log import get_logger

logger = get_logger(__name__)


def kernel_memory(
    accelerator: Accelerator,
    one_block_model: Callable[[], nn.Module],
    batch: Sequence[torch.Tensor],
    dtype: torch.dtype,
    optimizer_kernels: Callable[[torch.device], None] | None = None,
) -> int:
    """Bytes of device memory the run's kernels keep after their first use (module docstring).

    `one_block_model` builds a one-block copy of the run's model on the meta device; `batch` is one micro-batch
    of the run's shape (tokens, labels, then what the model takes after the tokens: positions, boundaries);
    `optimizer_kernels(device)`: the optimizer's own kernels beyond elementwise ones (Muon's Newton-Schulz).
    """
    gc.collect()  # garbage from before (the preflight's trace) freed inside the probe would offset what it keeps
    device = accelerator.current_device()

    def probe() -> None:
        _one_block_step(one_block_model, batch, dtype, device)
        if optimizer_kernels is not None:
            optimizer_kernels(device)

    kept = accelerator.memory_kept_by(probe)
    logger.info("Runtime memory: the kernels keep %.1f MiB after one probe step", kept / 2**20)
    return kept


def _one_block_step(
    one_block_model: Callable[[], nn.Module], batch: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device
) -> None:
    """Forward and backward of the one-block model on the micro-batch; frees all it allocated. Draws no random
    numbers: the weights are zeros, which every kernel runs on as on any other values."""
    model = one_block_model().to_empty(device=device).to(dtype)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.zero_()
    tokens, labels, *positions = (t.to(device) for t in batch)
    out = model(tokens, *positions)
    loss = token_loss_sum(out.logits, labels)
    for aux_loss in out.aux_losses.values():  # a mixture of experts' router loss: its backward runs too
        loss = loss + aux_loss
    loss.backward()
    del out, loss
    del model, tokens, labels, positions
    gc.collect()  # the autograd graph's cycles hold activations until collected
