"""What torchrun's environment says about this process: rank, world size, local ranks (defaults for one process).

Plain `os.environ` reads, free of torch, so `launch` can validate a config against the world size before
torch is imported.
"""

import os


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def env_local_world_size() -> int:
    """Processes of this run on this host (torchrun's LOCAL_WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
