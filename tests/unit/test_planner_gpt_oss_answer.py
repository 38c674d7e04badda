"""The planner's answer for a full fine-tune of gpt-oss-120b on one device (docs/gpt_oss.md, "The planner's answers"):
only FSDP2's CPU offload policy moves the parameters off the device, and then the host holds their fp32 shards and
AdamW's two states, which a 2 TiB node holds and a 1 TiB node does not. Held where the search's bound reads them
(`search.model_state`), against a parameter count worked out by hand from config.json."""

from pathlib import Path

import pytest
from test_planner_671b_answer import ON_DEVICE, ON_HOST  # the search's two leanest ways to hold the states

from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.planner.compose import Tracer
from internlm_offload.planner.search import model_state, over_budget
from internlm_offload.planner.trace import shared_sharding_decisions

pytestmark = pytest.mark.usefixtures("shared_traces")

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "plan_gpt_oss_120b.py"
GiB = 2**30


def parameters() -> int:
    """gpt-oss-120b's parameters from its config.json by hand: 36 blocks of 64 query heads of 64 and 8 kv heads (q/k/v/o
    biases, one sink a head), a router with a bias over 128 experts of 2880 with biases, two norms; the embedding and
    the untied head over 201088 tokens."""
    h, vocab, width, experts = 2880, 201088, 2880, 128
    attention = h * 4096 + 4096 + 2 * (h * 512 + 512) + 4096 * h + h + 64
    block = attention + experts * (h + 1) + experts * (3 * h * width + 2 * width + h) + 2 * h
    return 2 * vocab * h + h + 36 * block


def state(options: dict) -> tuple[tuple[int, int], int]:
    """(device, host) bytes of the parameters, masters and states of the one rank's step, and its NVMe bytes."""
    cfg = resolve_config(load_config_file(CONFIG, options), world_size=1)
    with shared_sharding_decisions():
        memory = Tracer(1).step(cfg, count_work=False, approximate=True)
    return model_state(memory), memory.disk_peak_bytes


def test_one_device_holds_gpt_oss_120b_only_with_its_parameters_on_a_2_tib_host():
    """116.8e9 parameters: kept on the device their fp32 shards alone are 435.2 GiB (> 80 GiB, the states on NVMe);
    on the host with AdamW's states 1305.7 GiB, over a 1 TiB node and within a 2 TiB one."""
    assert parameters() == 116_829_156_672
    (device, device_host), disk = state(ON_DEVICE)
    assert device == pytest.approx(4 * parameters(), rel=1e-4) and device_host == 0
    assert disk == pytest.approx(8 * parameters(), rel=1e-4)
    assert over_budget(device, 0, 80 * GiB, 2048 * GiB) == [("device", "device peak 435.2 GiB > budget 80.0 GiB")]
    (host_device, host), _ = state(ON_HOST)
    assert host_device < GiB and host == pytest.approx(12 * parameters(), rel=1e-4)
    assert over_budget(0, host, 24 * GiB, 1024 * GiB) == [("host", "host peak 1305.7 GiB > budget 1024.0 GiB")]
    assert over_budget(0, host, 24 * GiB, 2048 * GiB) == []
