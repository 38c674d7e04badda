"""Checkpoints are data, not code: every DCP read goes through `read_checkpoint` / `read_metadata`.

torch.distributed.checkpoint unpickles two things with the full pickle machinery: a checkpoint's
`.metadata` (`FileSystemReader.read_metadata`: plain `pickle.load`) and its non-tensor entries
(`DefaultLoadPlanner.load_bytes`: `torch.load(weights_only=False)`). A pickle can name any callable,
so a checkpoint downloaded or shared from elsewhere could run code on load. Here the metadata
unpickler resolves only DCP's metadata classes, torch sizes, dtypes and layouts, and plain builtins,
and every non-tensor entry must load under `torch.load(weights_only=True)` first. Anything else is
refused with `UnsafeCheckpointError` naming the file and what it would have loaded, before any of it
runs. (Tensor entries already load with `weights_only=True` inside DCP.) The unpicklers themselves are
`weights.safe_pickle`'s, shared with the foreign-weights readers.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from internlm_offload.weights.safe_pickle import AllowListUnpickler, UnsafeCheckpointError, load_data, torch_dtype

# What DCP (torch 2.6 - 2.13) writes into a `.metadata`, by module.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # maps a layout's name to torch's layout object, nothing else
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "bytearray", "complex", "slice", "range"},
}


def _metadata_unpickler(stream: Any, path: str) -> AllowListUnpickler:
    """Unpickles a DCP `.metadata`, resolving only the names in `_METADATA_CLASSES` and torch's dtypes."""

    def refusal(module: str, name: str) -> str:
        return (
            f"{path} would load {module}.{name}; a checkpoint's metadata may hold only DCP's metadata "
            "classes, torch sizes and dtypes and plain values: refusing to read it"
        )

    return AllowListUnpickler(stream, _METADATA_CLASSES, refusal, also=torch_dtype)


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with a `.metadata` unpickler that builds only data."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._metadata: dict[int | None, Metadata] = {}  # read once per file: DCP asks again inside `dcp.load`

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank not in self._metadata:
            path = self._get_metadata_path(rank)
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _metadata_unpickler(stream, str(path)).load()
            if not isinstance(metadata, Metadata):
                raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
            self._metadata[rank] = metadata
        metadata = self._metadata[rank]
        # As DCP's own reader does: older checkpoints carry no storage_meta; the load id marks this read.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that a non-tensor entry must load as plain data (`weights_only=True`)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        def refusal(what: str) -> str:
            return (
                f"{self.path}: entry {read_item.dest_index.fqn!r} would load {what}; "
                "checkpoint entries may hold only tensors and plain values: refusing to read it"
            )

        load_data(value, refusal)
        value.seek(0)
        super().load_bytes(read_item, value)  # the same bytes, now known to hold data only


def read_metadata(path: Path) -> Metadata:
    """A checkpoint's DCP metadata (what each entry is and where it lies), unpickled safely."""
    return SafeFileSystemReader(str(path)).read_metadata()


def read_checkpoint(
    path: Path, state: dict[str, Any], *, no_dist: bool = False, reader: SafeFileSystemReader | None = None
) -> None:
    """Fill `state` in place from the DCP checkpoint at `path` (resharded), building nothing but data.
    `reader`: one already opened on `path` (its metadata read once)."""
    reader, planner = reader or SafeFileSystemReader(str(path)), SafeLoadPlanner(path)
    reader.read_metadata()  # DCP would fold a refusal here into a generic failure: refuse first, in one line
    try:
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointException as exc:  # DCP gathers each rank's failure; a refusal is reported as itself
        failures = [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]
        refusal = next((error for error in failures if isinstance(error, UnsafeCheckpointError)), None)
        if refusal is not None:
            raise refusal from None
        raise
