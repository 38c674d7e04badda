"""train.py that first writes the model's weights as this run holds them, gathered: for the checkpoint tests.

GATHERED_WEIGHTS=path: before the first step (after a resume or a model-only load), rank 0 saves every tensor of
the checkpointed module's state dict there with `torch.save`, a DTensor as its full tensor (all ranks gather). Under
a pipeline every rank saves its stages' tensors to `path.rank<r>`.
"""

import os
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from internlm_offload.builder import build_trainer
from internlm_offload.launch import main


def gathering_build_trainer(*args, **kwargs):
    trainer = build_trainer(*args, **kwargs)
    train = trainer.train

    def gather_then_train() -> None:
        state = trainer.state_module.state_dict()
        full = {name: t.full_tensor() if isinstance(t, DTensor) else t.detach().clone() for name, t in state.items()}
        if trainer.ctx.pipeline_size > 1:  # each rank holds its own stages' tensors: a file per rank
            torch.save(full, f"{os.environ['GATHERED_WEIGHTS']}.rank{trainer.ctx.rank}")
        elif trainer.ctx.is_main:
            torch.save(full, os.environ["GATHERED_WEIGHTS"])
        train()

    trainer.train = gather_then_train
    return trainer


if __name__ == "__main__":
    sys.exit(main(build_trainer=gathering_build_trainer))
