"""Which sample indices each rank trains on at each step: deterministic, world-size invariant, resumable."""

from typing import Any

import torch
from torch import Tensor


class StepSampler:
    """Cut an infinite stream of per-epoch permutations into global batches and hand out this rank's share."""

    def __init__(
        self,
        num_samples: int,
        *,
        micro_bsz: int,
        micro_num: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        for name, value in (
            ("num_samples", num_samples),
            ("micro_bsz", micro_bsz),
            ("micro_num", micro_num),
            ("world_size", world_size),
        ):
            _check_int(name, value, minimum=1)
        _check_int("rank", rank, minimum=0)
        _check_int("seed", seed, minimum=0)
        if rank >= world_size:
            raise ValueError(f"rank: must be < world_size={world_size}, got {rank}")
        self.num_samples = num_samples
        self.micro_bsz = micro_bsz
        self.micro_num = micro_num
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.consumed_samples = 0
        self._epoch_cache: tuple[int, Tensor] | None = None  # (epoch, its order): one epoch kept

    @property
    def global_batch_size(self) -> int:
        """Samples consumed by all ranks together in one step."""
        return self.micro_bsz * self.micro_num * self.world_size

    def next_step(self) -> list[list[int]]:
        """Return this rank's micro_num micro-batches of sample indices and advance one step."""
        batch = self._stream_slice(self.consumed_samples, self.global_batch_size)
        self.consumed_samples += self.global_batch_size
        micro_batches = []
        for m in range(self.micro_num):
            # Rank-interleaved per micro-batch: the step's global set depends only on G, not on world_size.
            start = (m * self.world_size + self.rank) * self.micro_bsz
            micro_batches.append(batch[start : start + self.micro_bsz].tolist())
        return micro_batches

    def state_dict(self) -> dict[str, int]:
        """Return the position in the stream; identical on every rank."""
        return {"consumed_samples": self.consumed_samples, "seed": self.seed}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore the position saved by `state_dict`; the seed must match this sampler's."""
        missing = {"consumed_samples", "seed"} - set(sd)
        if missing:
            raise ValueError(f"sampler state: missing keys {sorted(missing)}")
        _check_int("sampler state consumed_samples", sd["consumed_samples"], minimum=0)
        _check_int("sampler state seed", sd["seed"], minimum=0)
        if sd["seed"] != self.seed:
            raise ValueError(f"sampler state: saved with seed={sd['seed']} but this run uses seed={self.seed}")
        self.consumed_samples = sd["consumed_samples"]

    def _stream_slice(self, start: int, count: int) -> Tensor:
        """Return entries [start, start + count) of the infinite index stream."""
        pieces = []
        while count > 0:
            epoch, offset = divmod(start, self.num_samples)
            take = min(count, self.num_samples - offset)
            pieces.append(self._epoch_order(epoch)[offset : offset + take])
            start += take
            count -= take
        return torch.cat(pieces)

    def _epoch_order(self, epoch: int) -> Tensor:
        """Return the sample order of `epoch`, cached until another epoch is asked for."""
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.num_samples, generator=gen)
            else:
                order = torch.arange(self.num_samples)
            self._epoch_cache = (epoch, order)
        return self._epoch_cache[1]


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    """Raise ValueError naming `name` unless `value` is an int >= minimum."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: must be an int >= {minimum}, got {value!r}")
