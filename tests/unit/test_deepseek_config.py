"""The config checks of a family whose architecture is config.json's count its blocks there (family.block_count:
config.json's num_hidden_layers), not the model section's `num_layers` (4 by default, which no DeepSeek-V3 has)."""

import pytest

from internlm_offload.config import resolve_config


def deepseek(blocks: int, **sections: object) -> dict:
    config = {"model_type": "deepseek_v3", "num_hidden_layers": blocks}
    return {"model": {"type": "deepseek_v3", "hf_config": config, **sections.pop("model", {})}, **sections}


def test_offloading_more_blocks_than_the_section_default_is_allowed_on_a_61_block_model() -> None:
    cfg = resolve_config(deepseek(61, cpu_offloading={"enable": True, "num_layers": 8}))
    assert cfg.cpu_offloading.num_layers == 8 and cfg.model.num_layers == 4  # the section's default, unread


def test_offloading_every_block_of_the_config_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"cpu_offloading.num_layers=6 must be < the config's num_hidden_layers=6"):
        resolve_config(deepseek(6, cpu_offloading={"enable": True, "num_layers": 6}))


def test_checkpointed_blocks_count_the_configs_blocks() -> None:
    assert resolve_config(deepseek(61, model={"checkpoint": 0.5})).checkpointed_layers() == 30
    assert resolve_config({"model": {"checkpoint": 0.5}}).checkpointed_layers() == 2  # the native section's 4 blocks
