"""One foreign file read as data: a torch.save'd state dict of tensors, or a JSON object. Anything else is
one `CheckpointError` line naming the file, never a raw exception from deep in a parser."""

import json
import zipfile
from pathlib import Path
from typing import Any

import torch

from internlm_offload.errors import CheckpointError
from internlm_offload.weights.safe_pickle import UnsafeCheckpointError, load_data


def load_model_file(path: Path) -> dict[str, torch.Tensor]:
    """One torch.save'd state dict of tensors, loaded as data only."""

    def refusal(what: str) -> str:
        return (
            f"{path} would load {what}; model files may hold only tensors: refusing to read it (InternEvo's "
            "FSDP files saved as ShardedTensor: save them once from InternEvo without FSDP)"
        )

    zipped = zipfile.is_zipfile(path)
    if not zipped and not _starts_as_pickle(path):
        raise CheckpointError(f"{path}: not a torch file (neither torch.save's zip archive nor a pickle)")
    try:
        # mmap (tensors backed by the page cache, not copied) needs torch's zip format; older files load whole
        state = load_data(path, refusal, map_location="cpu", mmap=zipped)
    except UnsafeCheckpointError as exc:
        raise CheckpointError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001  a file that is no pickle fails anywhere in the unpickler (KeyError, ...)
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        raise CheckpointError(f"{path}: not a readable torch file ({reason})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors")
    return state


def _starts_as_pickle(path: Path) -> bool:
    """Whether the file opens with pickle's PROTO opcode, as torch.save's legacy (pre-zip) format does; text
    or other binary data would otherwise reach the unpickler and fail as a refused "operand"."""
    with path.open("rb") as file:
        return file.read(1) == b"\x80"


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object (config.json, params.json, an index); one line naming it if not."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(value).__name__}; it must be an object ({{...}})")
    return value
