"""Run configuration: config files parsed (file.py), InternEvo keys translated (internevo.py), the typed schema
(sections.py, parallel.py, schema.py) validated and resolved for the world size (resolve.py); one-line errors (errors.py)
and sizes like '80GiB' (sizes.py). The names other packages use are importable from here."""

from internlm_offload.config.file import ConfigError, add_cfg_options, load_config_file, merge_overrides
from internlm_offload.config.resolve import (
    chunked_loss,
    data_parallel_size,
    expert_ranks,
    experts_over_tensor,
    experts_split_over_tensor,
    resolve_config,
    take_auto_knobs,
)
from internlm_offload.config.schema import RunConfig
from internlm_offload.config.sections import (
    AUTO,
    AUTO_KNOBS,
    TENSOR_MODES,
    CpuOffloadingConfig,
    LoadCkptInfo,
    ModelConfig,
    intermediate_size,
)
from internlm_offload.config.sizes import human_bytes, parse_size

__all__ = [
    "AUTO",
    "AUTO_KNOBS",
    "TENSOR_MODES",
    "ConfigError",
    "CpuOffloadingConfig",
    "LoadCkptInfo",
    "ModelConfig",
    "RunConfig",
    "add_cfg_options",
    "human_bytes",
    "intermediate_size",
    "load_config_file",
    "merge_overrides",
    "parse_size",
    "data_parallel_size",
    "expert_ranks",
    "experts_over_tensor",
    "experts_split_over_tensor",
    "chunked_loss",
    "resolve_config",
    "take_auto_knobs",
]
