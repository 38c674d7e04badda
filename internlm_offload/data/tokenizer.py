"""Tokenizers: a dependency-free byte tokenizer, and a wrapper over a local Hugging Face tokenizer."""

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from internlm_offload.data.corpus import DataError


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Return the token ids of `text`, without special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Return the text of `ids`, skipping special tokens."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus bos/eos/pad; needs no files and no download."""

    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258
    vocab_size: int = 259

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Return the text of the byte ids, skipping specials and replacing broken UTF-8."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory or a hub id already in the local cache (never downloads)."""

    def __init__(self, path: str) -> None:
        self._tok = _load_hf_tokenizer(tokenizer_folder(path))
        self.vocab_size: int = len(self._tok)
        self.eos_id: int = _first_not_none(self._tok.eos_token_id, self._tok.sep_token_id, 0)

    @property
    def backend(self) -> Any:
        """The transformers tokenizer itself (chat templates, offset mappings)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        """Return the token ids of `text`, without special tokens."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Return the text of `ids`, skipping special tokens."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


# A hub id as XTuner's configs write them ("Qwen/Qwen3-4B"): one slash, no path-only characters.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def tokenizer_folder(name: str) -> str:
    """The local folder of `name`: a directory as given, or a hub id's snapshot in the local Hugging Face cache.

    Offline as transformers is with `local_files_only=True`: a hub id that was never downloaded here is refused in
    one line, never fetched."""
    if Path(name).is_dir():
        return name
    if Path(name).exists() or not _HUB_ID.match(name):
        raise DataError(f"data.tokenizer: not a directory (and not 'byte' or a cached hub id 'org/name'): {name}")
    return _cached_snapshot(name)


def _cached_snapshot(repo_id: str) -> str:
    """The cached snapshot folder of the hub repository `repo_id` (HF_HUB_CACHE / HF_HOME decide where)."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as err:
        raise ImportError(
            f'a hub id in data.tokenizer needs transformers: pip install "internlm_offload[hf]" ({err})'
        ) from err
    try:
        return snapshot_download(repo_id, local_files_only=True)
    except LocalEntryNotFoundError:
        raise DataError(
            f"data.tokenizer={repo_id!r}: not a local directory and not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}; nothing is downloaded): run `hf download {repo_id}` where there is a "
            "network, or give the tokenizer's folder"
        ) from None


def _load_hf_tokenizer(path: str) -> Any:
    """Import transformers lazily and load the tokenizer at `path` from local files only."""
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise ImportError(f'HFTokenizer needs transformers: pip install "internlm_offload[hf]" ({err})') from err
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        # transformers reports a directory without tokenizer files as OSError / ValueError over many lines
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"data.tokenizer: cannot load a tokenizer from {path}: {first_line}") from None


def _first_not_none(*values: int | None) -> int:
    """Return the first value that is not None."""
    return next(v for v in values if v is not None)


def build_tokenizer(name: str = "byte") -> Tokenizer:
    """Return the byte tokenizer for "byte", else the Hugging Face tokenizer of the local directory or cached hub
    id `name`."""
    if name == "byte":
        return ByteTokenizer()
    return HFTokenizer(name)
