"""Check checkpoints against their manifests: `python -m internlm_offload.tools.verify_ckpt DIR`.

DIR is a checkpoint folder (`work_dirs/JOB/checkpoints`, every `step_*` in it is checked) or one
`step_*` folder. Each line names a checkpoint and says `intact` or `damaged: <what>` (a missing file,
a size or SHA-256 that differs from the manifest, no manifest at all). Exit code 0 when all are intact,
1 when any is damaged, 2 when DIR holds no checkpoint. Nothing is changed or deleted.
"""

import argparse
import sys
from pathlib import Path

from internlm_offload.engine.checkpoint import checkpoint_problems, read_manifest
from internlm_offload.engine.checkpoint_integrity import MANIFEST


def step_folders(folder: Path) -> list[Path]:
    """`folder` itself when it is one checkpoint, else its `step_*` folders, oldest first."""
    if (folder / MANIFEST).is_file():
        return [folder]
    return sorted(p for p in folder.glob("step_*") if p.is_dir())


def verdict(step: Path) -> tuple[bool, str]:
    """(intact, the words after the checkpoint's name)."""
    if not (step / MANIFEST).is_file():
        return False, f"damaged: no {MANIFEST} (a save that did not finish, or a partial copy)"
    problems = checkpoint_problems(step)
    if problems:
        return False, "damaged: " + "; ".join(problems)
    if "files" not in read_manifest(step):
        return True, "intact as far as can be told (written before manifests listed checksums)"
    return True, "intact"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check checkpoints against the sizes and SHA-256 in their manifests.")
    parser.add_argument("dir", type=Path, help="a checkpoint folder (its step_* folders are checked) or one step_*")
    args = parser.parse_args(argv)
    steps = step_folders(args.dir) if args.dir.is_dir() else []
    if not steps:
        print(f"error: {args.dir} holds no checkpoint (no step_* folder, no {MANIFEST})", file=sys.stderr)
        return 2
    damaged = 0
    for step in steps:
        intact, words = verdict(step)
        damaged += not intact
        print(f"{step.name}  {words}")
    return 1 if damaged else 0


if __name__ == "__main__":
    sys.exit(main())
