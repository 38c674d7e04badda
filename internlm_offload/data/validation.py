"""Validation data in InternEvo's layout: every folder under `data.valid_folder` holding `.bin` files is one set.

As in InternEvo, a validation sample is one document cut to `seq_len` tokens and padded (no packing),
the documents are split over the data-parallel ranks in order (rank r takes r, r + world, ...), and the
tail that does not fill a whole batch of `valid_micro_num * micro_bsz` documents on every rank is dropped,
so that all ranks run the same number of forwards.
"""

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from internlm_offload.data.corpus import DataError
from internlm_offload.data.tokenized import IGNORE_INDEX, BinFile, find_bin_files, open_bin_file


@dataclass
class ValidationSet:
    """One named set: its documents as (file, document index) pairs, in file order."""

    name: str
    documents: list[tuple[BinFile, int]]
    seq_len: int

    def __len__(self) -> int:
        return len(self.documents)

    def sample(self, index: int) -> tuple[Tensor, Tensor]:
        """(input_ids, labels), each (seq_len,): the document cut to seq_len, zero-padded, pads unlabelled."""
        file, doc = self.documents[index]
        tokens = file.document(doc)[: self.seq_len]
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        labels[: len(tokens) - 1] = tokens[1:]
        labels[labels <= 0] = IGNORE_INDEX
        inputs = np.zeros(self.seq_len, dtype=np.int64)
        inputs[: len(tokens)] = np.abs(tokens)
        return torch.from_numpy(inputs), torch.from_numpy(labels)

    def rank_batches(self, *, rank: int, world_size: int, micro_bsz: int, valid_micro_num: int) -> list[list[int]]:
        """This rank's micro-batches of document indices; every rank gets the same number."""
        per_rank = len(self) // world_size
        batch = min(valid_micro_num * micro_bsz, per_rank) // micro_bsz * micro_bsz
        if batch == 0:
            return []
        mine = [rank + k * world_size for k in range(per_rank // batch * batch)]
        return [mine[i : i + micro_bsz] for i in range(0, len(mine), micro_bsz)]


def find_validation_sets(folder: str, *, seq_len: int, min_length: int) -> list[ValidationSet]:
    """The sets under `folder`, named after the directory holding their `.bin` files, in sorted order."""
    by_dir: dict[str, list[tuple[BinFile, int]]] = defaultdict(list)
    for path in find_bin_files(folder, "data.valid_folder"):
        file = open_bin_file(path, min_length)
        by_dir[path.parent.name].extend((file, i) for i in range(len(file)))
    sets = [ValidationSet(name, docs, seq_len) for name, docs in by_dir.items() if docs]
    if not sets:
        raise DataError(f"data.valid_folder: no document of >= data.min_length={min_length} tokens under {folder}")
    return sets
