"""Tokenizers: a dependency-free byte tokenizer, and a wrapper over a local Hugging Face tokenizer."""

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
    """A Hugging Face tokenizer loaded from a local directory (never downloads)."""

    def __init__(self, path: str) -> None:
        if not Path(path).is_dir():
            raise DataError(f"data.tokenizer: not a directory (and not 'byte'): {path}")
        self._tok = _load_hf_tokenizer(path)
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
    """Return the byte tokenizer for "byte", else the Hugging Face tokenizer in the local directory `name`."""
    if name == "byte":
        return ByteTokenizer()
    return HFTokenizer(name)
