"""Train from a config file: `python train.py --config configs/internlm2_tiny.py`, or under torchrun."""

import sys

from internlm_offload.launch import main

if __name__ == "__main__":
    sys.exit(main())
