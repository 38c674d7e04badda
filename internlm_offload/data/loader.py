"""Turn a step's sample indices into stacked tensors; in-process, since the data already lives in memory."""

from typing import Any

import torch
from torch import Tensor

from internlm_offload.data.packed import PackedDataset
from internlm_offload.data.sampler import StepSampler


class StepLoader:
    """Yield one training step at a time: micro_num (input_ids, labels) pairs of shape (micro_bsz, seq_len)."""

    def __init__(self, dataset: PackedDataset, sampler: StepSampler) -> None:
        if sampler.num_samples != len(dataset):
            raise ValueError(f"sampler covers {sampler.num_samples} samples but the dataset has {len(dataset)}")
        self.dataset = dataset
        self.sampler = sampler

    @property
    def tokens_per_step_global(self) -> int:
        """Tokens trained on by all ranks together in one step."""
        return self.sampler.global_batch_size * self.dataset.seq_len

    def next_step(self) -> list[tuple[Tensor, Tensor]]:
        """Return this rank's micro-batches for the next step."""
        return [self._collate(indices) for indices in self.sampler.next_step()]

    def _collate(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        """Stack the samples at `indices` into (input_ids, labels)."""
        samples = [self.dataset[i] for i in indices]
        return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])

    def state_dict(self) -> dict[str, int]:
        """Return the sampler's position."""
        return self.sampler.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore the sampler's position."""
        self.sampler.load_state_dict(sd)
