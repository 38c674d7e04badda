"""bench/layouts.py: every layout it trains is a config the trainer takes on its process count, and its comparison
reads the largest relative difference (the runs themselves: tests/e2e/test_deepseek_parallel_e2e.py and
test_pipeline_moe_e2e.py at 6 steps)."""

import argparse

import pytest

from internlm_offload.bench.layouts import COMMON, LAYOUTS, REPO, largest_relative_difference
from internlm_offload.config import add_cfg_options, load_config_file, resolve_config
from internlm_offload.model.families.deepseek_v3.build import check_run


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_each_layout_resolves_on_its_processes(name):
    layout = LAYOUTS[name]
    parser = argparse.ArgumentParser()
    add_cfg_options(parser, help="")
    options = parser.parse_args(["--cfg-options", *COMMON, "data.total_steps=20", *layout.options]).cfg_options
    raw = load_config_file(REPO / "configs" / "deepseek_v3_tiny.py", options)
    cfg = resolve_config(raw, world_size=layout.nproc)
    check_run(cfg)
    assert cfg.model.mtp_config.num_layers == 1  # every layout trains multi-token prediction


def test_the_largest_relative_difference():
    assert largest_relative_difference([2.0, 0.0, 4.0], [2.0, 0.0, 4.0]) == 0.0
    assert largest_relative_difference([2.0, 4.0], [2.1, 4.0]) == pytest.approx(0.05)
    assert largest_relative_difference([0.0], [1e-9]) == 1e-9  # against 0: the absolute difference
    with pytest.raises(ValueError, match="1 steps against 2"):
        largest_relative_difference([1.0, 2.0], [1.0])
