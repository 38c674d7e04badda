"""InternEvo's tokenized data: folders of `.bin` files with `.bin.meta` indexes, packed as InternEvo packs them.

A `.bin` file holds one JSON object per line, `{"tokens": [...]}` (other keys are ignored); its `.bin.meta`
is a numpy array with one row per line: (byte offset, ..., token count). Documents are read lazily
through mmap, so a folder larger than memory trains. Token ids <= 0 are InternEvo's "no loss" marks:
the model sees their absolute value and their labels are ignored (-100).

Packing follows InternEvo, file by file with its fixed shuffle seed 1024, so a pack here holds the
same tokens as InternEvo's pack with the same index:
- `pack_sample_into_one=True`: the shuffled documents are one stream cut every `seq_len * micro_bsz`
  tokens; a pack is `micro_bsz` rows of `seq_len` and attention crosses documents within a row.
- `pack_sample_into_one=False`: same stream and cut, but a pack is one row whose documents stay
  apart: positions restart at each document (and every `seq_len` tokens within a long one) and
  attention never crosses a boundary. The boundaries travel as `position_ids`.
"""

import json
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from internlm_offload.data.corpus import DataError
from internlm_offload.registry import DATASETS

IGNORE_INDEX = -100
SHUFFLE_SEED = 1024  # InternEvo's fixed per-file document shuffle


class DocumentFile(Protocol):
    """One file's documents, as the packer reads them: `lengths[i]` tokens each."""

    path: Path
    lengths: np.ndarray

    def __len__(self) -> int: ...

    def targets(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Document `index`: its token ids and, per token, whether it is a target (its loss counts)."""
        ...


@dataclass
class BinFile:
    """One `.bin` file: the byte offset and token count of each document kept after the length filter."""

    path: Path
    offsets: np.ndarray
    lengths: np.ndarray
    _mmap: mmap.mmap | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.offsets)

    def document(self, index: int) -> np.ndarray:
        """The tokens of document `index` (int64, signs kept)."""
        offset = int(self.offsets[index])
        view = self._view()
        end = view.find(b"\n", offset)
        line = view[offset : end if end >= 0 else len(view)]
        try:
            tokens = json.loads(line)["tokens"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise DataError(
                f'{self.path}: the line at byte {offset} is not a JSON object with a "tokens" list'
            ) from None
        if len(tokens) != self.lengths[index]:
            raise DataError(
                f"{self.path}: the line at byte {offset} has {len(tokens)} tokens but the .meta says "
                f"{int(self.lengths[index])}; the .meta belongs to another file, regenerate it"
            )
        return np.asarray(tokens, dtype=np.int64)

    def targets(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """InternEvo's signs: a token id <= 0 is the id's absolute value, and not a target."""
        tokens = self.document(index)
        return np.abs(tokens), tokens > 0

    def _view(self) -> mmap.mmap:
        if self._mmap is None:
            with self.path.open("rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mmap


def write_bin_file(path: Path, documents: "list[list[int]]") -> None:
    """Write documents as InternEvo does: `path` (JSON lines) and `path.meta` (rows of byte offset, token count)."""
    rows, offset = [], 0
    with Path(path).open("wb") as out:
        for tokens in documents:
            line = (json.dumps({"tokens": [int(t) for t in tokens]}) + "\n").encode()
            out.write(line)
            rows.append((offset, len(tokens)))
            offset += len(line)
    with Path(f"{path}.meta").open("wb") as meta:  # a file object: np.save would append .npy to a name
        np.save(meta, np.asarray(rows, dtype=np.int64).reshape(-1, 2))


def find_bin_files(folder: str, key: str) -> list[Path]:
    """Every `.bin` file under `folder`, directories and files in sorted order (InternEvo's walk)."""
    if not Path(folder).is_dir():
        raise DataError(f"{key}: not a directory: {folder}")
    found = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs.sort()
        found.extend(Path(root) / name for name in sorted(files) if name.endswith(".bin"))
    if not found:
        raise DataError(f"{key}: no .bin files under {folder}")
    return found


def open_bin_file(path: Path, min_length: int) -> BinFile:
    """Read the `.bin.meta` of `path` and keep the documents of at least `min_length` tokens."""
    meta_path = Path(f"{path}.meta")
    if not meta_path.is_file():
        raise DataError(f"{path}: its index {meta_path.name} is missing (InternEvo's tokenizer writes both)")
    try:
        meta = np.load(meta_path, allow_pickle=False)
    except (ValueError, OSError) as err:
        raise DataError(f"{meta_path}: not a numpy array file ({err})") from None
    if meta.ndim != 2 or meta.shape[1] < 2:
        raise DataError(f"{meta_path}: expected rows of (byte offset, ..., token count), got shape {meta.shape}")
    offsets, lengths = meta[:, 0].astype(np.int64), meta[:, -1].astype(np.int64)
    keep = lengths >= min_length
    return BinFile(path, offsets[keep], lengths[keep])


@dataclass(frozen=True)
class _Chunk:
    """Tokens [start, end) of document `doc` of a file."""

    doc: int
    start: int
    end: int


class _FilePacks:
    """The packs of one file: its documents in InternEvo's shuffled order, cut every `pack_len` tokens."""

    def __init__(self, file: DocumentFile, pack_len: int) -> None:
        self.file = file
        self.pack_len = pack_len
        order = np.arange(len(file))
        np.random.RandomState(SHUFFLE_SEED).shuffle(order)
        self.order = order
        self.ends = np.cumsum(file.lengths[order])  # stream position where each shuffled document ends
        total = int(self.ends[-1]) if len(self.ends) else 0
        self.num_packs = total // pack_len

    def chunks(self, pack: int) -> list[_Chunk]:
        """The document pieces that make up pack `pack`, in stream order."""
        begin, end = pack * self.pack_len, (pack + 1) * self.pack_len
        first = int(np.searchsorted(self.ends, begin, side="right"))
        out = []
        for pos in range(first, len(self.ends)):
            doc_begin = int(self.ends[pos]) - int(self.file.lengths[self.order[pos]])
            if doc_begin >= end:
                break
            start, stop = max(begin, doc_begin) - doc_begin, min(end, int(self.ends[pos])) - doc_begin
            out.append(_Chunk(int(self.order[pos]), start, stop))
        return out


class InternEvoPackedDataset:
    """InternEvo's training packs over files of documents (`.bin` files, or tokenized chat); sample i is one
    micro-batch. `source` names the documents in errors (`data.train_folder: <folder> holds ...`)."""

    def __init__(
        self,
        files: Sequence[DocumentFile],
        *,
        seq_len: int,
        micro_bsz: int,
        pack_sample_into_one: bool,
        source: str,
        vocab_size: int | None = None,
    ) -> None:
        self.seq_len = seq_len
        self.micro_bsz = micro_bsz
        self.pack_len = seq_len * micro_bsz
        self.keep_documents_apart = not pack_sample_into_one
        self.vocab_size = vocab_size
        self.files = [packs for packs in (_FilePacks(f, self.pack_len) for f in files) if packs.num_packs > 0]
        self._starts = np.cumsum([0] + [p.num_packs for p in self.files])
        if not self.files:
            tokens = sum(int(f.lengths.sum()) for f in files)
            raise DataError(
                f"{source} holds {tokens} tokens, fewer than one pack of seq_len * micro_bsz = {self.pack_len}"
            )

    @property
    def tokens_per_sample(self) -> int:
        return self.pack_len

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> tuple[Tensor, ...]:
        """(input_ids, labels) of shape (micro_bsz, seq_len), or with documents apart
        (input_ids, labels, position_ids) of shape (1, seq_len * micro_bsz)."""
        if not 0 <= index < len(self):
            raise IndexError(f"pack {index} out of range for {len(self)} packs")
        f = int(np.searchsorted(self._starts, index, side="right")) - 1
        packs = self.files[f]
        tokens, labels, positions = self._build(packs, index - int(self._starts[f]))
        self._check_vocab(tokens, packs.file.path)
        inputs, labels = torch.from_numpy(tokens), torch.from_numpy(labels)
        if self.keep_documents_apart:
            return inputs[None], labels[None], torch.from_numpy(positions)[None]
        return inputs.view(self.micro_bsz, self.seq_len), labels.view(self.micro_bsz, self.seq_len)

    def _build(self, packs: _FilePacks, pack: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens, labels and positions of one pack, from its document chunks."""
        tokens, labels, positions = [], [], []
        for chunk in packs.chunks(pack):
            ids, is_target = packs.file.targets(chunk.doc)
            # Token i's label is token i+1 where that one is a target. The label of a chunk's last token: the
            # document's next token when the document goes on into the next pack (kept apart: InternEvo's
            # cut packing), else nothing to predict.
            goes_on = chunk.end < len(ids) and self.keep_documents_apart
            stop = chunk.end + 1 if goes_on else chunk.end
            following = np.where(is_target[chunk.start + 1 : stop], ids[chunk.start + 1 : stop], IGNORE_INDEX)
            padding = [] if goes_on else [IGNORE_INDEX]
            tokens.append(ids[chunk.start : chunk.end])
            labels.append(np.concatenate([following, np.array(padding, dtype=np.int64)]))
            positions.append(_piece_positions(chunk.end - chunk.start, self.seq_len))
        return np.concatenate(tokens), np.concatenate(labels), np.concatenate(positions)

    def _check_vocab(self, tokens: np.ndarray, path: Path) -> None:
        if self.vocab_size is None:
            return
        largest = int(tokens.max())
        if largest >= self.vocab_size:
            raise DataError(
                f"{path} has token id {largest}, but model.vocab_size={self.vocab_size}; "
                "the data was tokenized for a larger vocabulary"
            )


def _piece_positions(length: int, seq_len: int) -> np.ndarray:
    """Positions of a chunk kept apart: they restart every `seq_len` tokens (InternEvo's max_length_per_sample)."""
    return np.arange(length, dtype=np.int64) % seq_len


def build_internevo_dataset(
    *,
    seq_len: int,
    micro_bsz: int,
    train_folder: str,
    pack_sample_into_one: bool,
    min_length: int,
    vocab_size: int | None = None,
) -> InternEvoPackedDataset:
    """Build InternEvo's training packs over `train_folder`."""
    files = [open_bin_file(path, min_length) for path in find_bin_files(train_folder, "data.train_folder")]
    return InternEvoPackedDataset(
        files,
        seq_len=seq_len,
        micro_bsz=micro_bsz,
        pack_sample_into_one=pack_sample_into_one,
        source=f"data.train_folder: {train_folder} (documents of >= data.min_length={min_length} tokens)",
        vocab_size=vocab_size,
    )


DATASETS.register_module(name="internevo", module=build_internevo_dataset)
