"""train.py on a disk that fills up, without filling one: for the checkpoint-failure tests.

FULL_DISK_RANK=r FULL_DISK_FROM_STEP=s: rank r's DCP writer fails with ENOSPC for checkpoints of step s on.
FULL_DISK_FREE=n: the checkpoint folder's file system reports n bytes free.
"""

import errno
import os
import sys
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from internlm_offload.builder import build_trainer
from internlm_offload.engine import checkpoint
from internlm_offload.launch import main

write_data = FileSystemWriter.write_data


def write_data_until_full(self, plan, planner):
    step = int(Path(self.path).name.rsplit("_", 1)[-1])  # .tmp-step_00000004
    if os.environ.get("RANK", "0") == os.environ["FULL_DISK_RANK"] and step >= int(os.environ["FULL_DISK_FROM_STEP"]):
        raise OSError(errno.ENOSPC, "No space left on device")
    return write_data(self, plan, planner)


if "FULL_DISK_RANK" in os.environ:
    FileSystemWriter.write_data = write_data_until_full
if "FULL_DISK_FREE" in os.environ:
    checkpoint.free_bytes = lambda folder: int(os.environ["FULL_DISK_FREE"])

if __name__ == "__main__":
    sys.exit(main(build_trainer=build_trainer))
