"""A folder's weight files read one tensor at a time (FSDP2's meta build reads a folder into the shards so): a
safetensors file is opened at its first tensor read and closed after its last, so the host maps the files of the
piece being read, not the folder."""

from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from internlm_offload.errors import CheckpointError
from internlm_offload.weights.files import load_model_file


class TensorFiles:
    """The tensors of `files` (`hf_folder.weight_files`) by name; `read` one, after `expect` named those to be read."""

    def __init__(self, files: list[Path]) -> None:
        self.where: dict[str, Path] = {}
        self._open: dict[Path, Any] = {}
        for path in files:
            handle = self._opened(path)
            self.where.update(dict.fromkeys(handle.keys(), path))
            self._open.pop(path)  # the header alone, read again when the file's first tensor is
        self._left: Counter[Path] = Counter()

    def expect(self, names: Iterable[str]) -> None:
        """The names `read` will be called with, each once: a file closes after the last of them."""
        self._left = Counter(self.where[name] for name in names)

    def read(self, name: str) -> torch.Tensor:
        path = self.where[name]
        handle = self._open.get(path) or self._opened(path)
        tensor = handle.get_tensor(name) if path.suffix == ".safetensors" else handle[name]
        self._left[path] -= 1
        if self._left[path] <= 0:
            self._open.pop(path, None)  # dropped: its mapping goes with it
        return tensor

    def close(self) -> None:
        self._open.clear()

    def _opened(self, path: Path) -> Any:
        """A safetensors file's reader (its header read, no tensor), or a .bin file's tensors (mapped: torch's zip)."""
        from safetensors import safe_open

        if path.suffix != ".safetensors":
            handle: Any = load_model_file(path)
        else:
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as exc:  # noqa: BLE001  safetensors raises its own type for a damaged header
                reason = " ".join(str(exc).split())[:200]
                raise CheckpointError(f"{path}: not a readable safetensors file ({reason})") from None
        self._open[path] = handle
        return handle
