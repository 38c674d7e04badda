"""Validation: token-mean loss and perplexity of each validation set, reduced over the data-parallel ranks."""

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from internlm_offload.data.tokenized import IGNORE_INDEX
from internlm_offload.data.validation import ValidationSet
from internlm_offload.engine.loss import token_loss_sum
from internlm_offload.engine.sequence_parallel import SequenceShard
from internlm_offload.engine.tensor_parallel import local_loss, loss_context


class Evaluator:
    """Runs every validation set through the model in eval mode, without autograd (so no offload hook arms)."""

    def __init__(
        self,
        sets: Sequence[ValidationSet],
        *,
        rank: int,
        world_size: int,
        micro_bsz: int,
        valid_micro_num: int,
        device: torch.device,
        distributed: bool,
        loss_parallel: bool = False,
        group: dist.ProcessGroup | None = None,
        sequence_shard: SequenceShard | None = None,
    ) -> None:
        """`loss_parallel`: vocab-sharded logits (tensor parallel); `group`: whom the sums are reduced over (None:
        all ranks); `sequence_shard` (isp): the model returns this rank's chunk, the labels are cut to match."""
        self.sets = list(sets)
        self.device = device
        self.distributed = distributed
        self.loss_parallel = loss_parallel
        self.group = group
        self.sequence_shard = sequence_shard
        sizes = dict(rank=rank, world_size=world_size, micro_bsz=micro_bsz, valid_micro_num=valid_micro_num)
        self._batches = {s.name: s.rank_batches(**sizes) for s in self.sets}

    @property
    def empty_sets(self) -> list[str]:
        """Sets too small to give every rank one micro-batch (they are skipped)."""
        return [name for name, batches in self._batches.items() if not batches]

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """`valid_loss`/`valid_ppl` over all sets, and per set `valid_loss/<name>` when there are several."""
        was_training = model.training
        model.eval()
        try:
            sums = torch.stack([self._loss_and_tokens(model, s) for s in self.sets])  # (sets, 2)
        finally:
            model.train(was_training)
        if self.distributed:
            dist.all_reduce(sums, group=self.group)
        per_set = sums.tolist()
        total_loss, total_tokens = (sum(col) for col in zip(*per_set))
        record = _loss_record("", total_loss, total_tokens)
        if len(self.sets) > 1:
            for s, (loss, tokens) in zip(self.sets, per_set):
                record.update(_loss_record(f"/{s.name}", loss, tokens))
        return record

    def _loss_and_tokens(self, model: nn.Module, vset: ValidationSet) -> torch.Tensor:
        """(loss sum, labelled tokens) of this rank's share of `vset`, as a float64 device tensor."""
        acc = torch.zeros(2, dtype=torch.float64, device=self.device)
        for indices in self._batches[vset.name]:
            samples = [vset.sample(i) for i in indices]
            input_ids = torch.stack([s[0] for s in samples]).to(self.device)
            labels = torch.stack([s[1] for s in samples]).to(self.device)
            with loss_context(self.loss_parallel):
                logits = model(input_ids).logits  # the auxiliary losses are training's, not the validation loss
                if self.sequence_shard is not None:
                    labels = self.sequence_shard.local(labels)
                loss = local_loss(token_loss_sum(logits, labels))
            acc += torch.stack([loss.double(), (labels != IGNORE_INDEX).sum().double()])
        return acc


def _loss_record(suffix: str, loss_sum: float, tokens: float) -> dict[str, float]:
    loss = loss_sum / tokens if tokens else float("nan")
    ppl = float("inf") if loss > 700 else math.exp(loss)  # nan stays nan; beyond ~709 exp overflows
    return {f"valid_loss{suffix}": loss, f"valid_ppl{suffix}": ppl}
