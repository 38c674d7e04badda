"""The pipeline tests' config: configs/internlm2_tiny_pp2.py resolved with dotted options."""

from pathlib import Path
from typing import Any

from internlm_offload.config import RunConfig, load_config_file, resolve_config

PP2 = Path(__file__).resolve().parents[2] / "configs" / "internlm2_tiny_pp2.py"


def resolve(world_size: int, options: dict[str, Any]) -> RunConfig:
    """configs/internlm2_tiny_pp2.py (pipeline=dict(size=2), 4 micro-batches) with dotted `options` set."""
    return resolve_config(load_config_file(PP2, options), world_size=world_size)
