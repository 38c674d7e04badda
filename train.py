"""Train from a config file: `python train.py --config configs/internlm2_tiny.py`, or under torchrun.

Wires the two halves of a run: `launch` (command line, validation, start-up, exit codes) and `builder`
(a validated config -> the trainer).
"""

import sys

from internlm_offload.launch import main


def build_trainer(*args, **kwargs):
    """`builder.build_trainer`, imported once the config is valid: a bad config never waits for torch."""
    from internlm_offload.builder import build_trainer as build

    return build(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main(build_trainer=build_trainer))
