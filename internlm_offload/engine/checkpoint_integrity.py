"""Whether a checkpoint is still whole: the manifest lists every file with its size and SHA-256, and a check
compares them with what is on disk.

The hashes are the ones `sha256sum` prints, so a user can check a copied checkpoint by hand. Hashing is
split across ranks (`share`): each reads a disjoint part of the files, so a checkpoint is read once in
all, not once per rank. A manifest written before file lists existed has no `files` entry; such a
checkpoint counts as intact (it cannot be checked) and says so.
"""

import hashlib
import shutil
from pathlib import Path
from typing import Any

from internlm_offload.config.sizes import human_bytes

MANIFEST = "manifest.json"
READ_CHUNK = 8 << 20

Share = tuple[int, int]  # (rank, world size): this rank handles files[rank::world]
WHOLE: Share = (0, 1)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_files(folder: Path) -> list[str]:
    """Every file of a checkpoint folder but its manifest, as sorted relative paths."""
    found = (p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    return sorted(p.relative_to(folder).as_posix() for p in found)


def record_files(folder: Path, names: list[str], share: Share = WHOLE) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of this rank's share of `names` (relative to `folder`)."""
    rank, world = share
    return {
        name: {"size": (folder / name).stat().st_size, "sha256": sha256_of(folder / name)}
        for name in names[rank::world]
    }


def file_problem(folder: Path, name: str, expected: dict[str, Any]) -> str | None:
    """What is wrong with one listed file, or None when it matches the manifest."""
    path = folder / name
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size != expected["size"]:
        return f"{name} has {human_bytes(size)}, the manifest says {human_bytes(expected['size'])}"
    if sha256_of(path) != expected["sha256"]:
        return f"{name} does not match its SHA-256 in the manifest"
    return None


def damaged_files(folder: Path, listed: dict[str, dict[str, Any]], share: Share = WHOLE) -> list[str]:
    """This rank's share of the problems with `listed` files (the manifest's `files`); empty: intact."""
    rank, world = share
    problems = (file_problem(folder, name, listed[name]) for name in sorted(listed)[rank::world])
    return [p for p in problems if p is not None]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def free_bytes(folder: Path) -> int:
    """Free space on the file system that holds `folder` (or would, once it is created)."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free
