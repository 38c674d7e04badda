"""Packed language-modelling samples: documents joined by eos into one token stream, cut into windows."""

from collections.abc import Sequence

import torch
from torch import Tensor

from internlm_offload.data.corpus import DataError, builtin_documents, read_documents
from internlm_offload.data.tokenizer import ByteTokenizer, Tokenizer
from internlm_offload.registry import DATASETS


class PackedDataset:
    """Sample i is tokens[i*seq_len : i*seq_len + seq_len + 1], split into (input_ids, labels)."""

    def __init__(self, documents: Sequence[str], tokenizer: Tokenizer, seq_len: int) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise DataError(f"data.seq_len: must be a positive int, got {seq_len!r}")
        self.seq_len = seq_len
        self.tokens = _tokenize_stream(documents, tokenizer)
        self._num_samples = (self.tokens.numel() - 1) // seq_len
        if self._num_samples <= 0:
            raise DataError(
                f"data.seq_len: seq_len={seq_len} needs at least {seq_len + 1} tokens for one sample, "
                f"but the documents give only {self.tokens.numel()} tokens"
            )

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len

    def __len__(self) -> int:
        """Return the number of samples (the incomplete tail is dropped)."""
        return self._num_samples

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        """Return (input_ids, labels) of sample `index`, LongTensors of length seq_len."""
        if not -self._num_samples <= index < self._num_samples:
            raise IndexError(f"sample {index} out of range for {self._num_samples} samples")
        start = (index % self._num_samples) * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]


def _tokenize_stream(documents: Sequence[str], tokenizer: Tokenizer) -> Tensor:
    """Return every document's tokens followed by eos, concatenated into one int32 tensor."""
    eos = torch.tensor([tokenizer.eos_id], dtype=torch.int32)
    pieces: list[Tensor] = []
    for doc in documents:
        pieces.append(_encode(tokenizer, doc))
        pieces.append(eos)
    if not pieces:
        return torch.empty(0, dtype=torch.int32)
    return torch.cat(pieces)


def _encode(tokenizer: Tokenizer, text: str) -> Tensor:
    """Tokenize one document into an int32 tensor."""
    if isinstance(tokenizer, ByteTokenizer):
        # Byte ids are the UTF-8 bytes themselves: view them without a Python int per token.
        raw = bytearray(text.encode("utf-8"))
        if not raw:  # torch.frombuffer rejects empty buffers
            return torch.empty(0, dtype=torch.int32)
        return torch.frombuffer(raw, dtype=torch.uint8).to(torch.int32)
    return torch.tensor(tokenizer.encode(text), dtype=torch.int32)


def build_builtin_dataset(*, seq_len: int, tokenizer: Tokenizer) -> PackedDataset:
    """Build the packed dataset over CPython's pydoc help topics (needs no files)."""
    return PackedDataset(builtin_documents(), tokenizer, seq_len)


def build_text_dataset(*, seq_len: int, tokenizer: Tokenizer, paths: Sequence[str]) -> PackedDataset:
    """Build the packed dataset over local .txt / .jsonl files and directories of them."""
    return PackedDataset(read_documents(paths), tokenizer, seq_len)


DATASETS.register_module(name="builtin", module=build_builtin_dataset)
DATASETS.register_module(name="text", module=build_text_dataset)
