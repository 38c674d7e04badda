"""Turn a step's sample indices into stacked tensors, in-process (samples are in memory or mmapped)."""

from typing import Any, Protocol

import torch
from torch import Tensor

from internlm_offload.data.sampler import StepSampler

MicroBatch = tuple[Tensor, ...]  # (input_ids, labels) or (input_ids, labels, position_ids), each (rows, T)


class Dataset(Protocol):
    """What the loader needs: samples of (input_ids, labels[, position_ids]), each (T,) or (rows, T)."""

    tokens_per_sample: int

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> MicroBatch: ...


class StepLoader:
    """Yield one training step at a time: micro_num micro-batches, the sampler's micro_bsz samples each."""

    def __init__(self, dataset: Dataset, sampler: StepSampler) -> None:
        if sampler.num_samples != len(dataset):
            raise ValueError(f"sampler covers {sampler.num_samples} samples but the dataset has {len(dataset)}")
        self.dataset = dataset
        self.sampler = sampler

    @property
    def tokens_per_step_global(self) -> int:
        """Tokens trained on by all ranks together in one step."""
        return self.sampler.global_batch_size * self.dataset.tokens_per_sample

    @property
    def batches_drawn(self) -> int:
        """Steps' worth of batches taken from the stream so far (the index of the next one)."""
        return self.sampler.consumed_samples // self.sampler.global_batch_size

    def next_step(self) -> list[MicroBatch]:
        """Return this rank's micro-batches for the next step."""
        return [self._collate(indices) for indices in self.sampler.next_step()]

    def _collate(self, indices: list[int]) -> MicroBatch:
        """Stack the samples at `indices` row-wise, field by field."""
        samples = [self.dataset[i] for i in indices]
        return tuple(torch.cat([field.view(-1, field.shape[-1]) for field in fields]) for fields in zip(*samples))

    def state_dict(self) -> dict[str, int]:
        """Return the sampler's position."""
        return self.sampler.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore the sampler's position."""
        self.sampler.load_state_dict(sd)
