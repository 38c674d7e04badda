"""The planner's answer for a full fine-tune of DeepSeek-V3 671B on one node (docs/deepseek.md, "The planner's
answers"): no setting the trainer offers fits 8 x 141 GiB with 2 TiB of host and NVMe, for the two reasons the search
prints. Held where the search's bound reads them (`search.model_state`: the parameters, masters and optimizer states,
which compose exactly from reduced models), against a parameter count worked out by hand from config.json."""

from pathlib import Path

import pytest

from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.planner.compose import Tracer
from internlm_offload.planner.search import model_state, over_budget
from internlm_offload.planner.trace import shared_sharding_decisions

pytestmark = pytest.mark.usefixtures("shared_traces")

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "plan_deepseek_v3_671b.py"
RANKS, GiB = 8, 2**30
DEVICE, HOST = 141 * GiB, 2048 * GiB // RANKS  # one node: 8 x 141 GiB, 2 TiB shared by its 8 ranks

# the search's two leanest ways to hold the states (tools.plan's settings, checkpointing every block)
ON_DEVICE = {  # the fp32 shards stay on the device as the masters; AdamW's states on NVMe, the gradients on the host
    "swap_optimizer": True,
    "grad_offload": True,
    "nvme_offload.enable": True,
    "nvme_offload.path": "/local_nvme",
    "model.checkpoint": 1.0,
}
ON_HOST = {"parallel.fsdp_cpu_offload": True, "model.checkpoint": 1.0}  # shards, gradients and states on the host


def parameters() -> int:
    """DeepSeek-V3's parameters from its config.json by hand: 61 blocks (3 dense-first), MLA, 256 routed experts and
    one shared, and the multi-token-prediction layer (one sparse block, two norms, eh_proj and the head's norm)."""
    h, vocab, heads = 7168, 129280, 128
    attention = h * 1536 + 1536 + 1536 * heads * (128 + 64) + h * (512 + 64) + 512 + 512 * heads * (128 + 128)
    attention += heads * 128 * h  # o_proj
    dense, sparse = 3 * h * 18432, 256 * h + 256 * 3 * h * 2048 + 3 * h * 2048  # router, routed experts, shared
    block = attention + 2 * h  # and its two norms
    main = 2 * vocab * h + h + 3 * (block + dense) + 58 * (block + sparse)
    mtp = 2 * h + 2 * h * h + h + block + sparse
    return main + mtp


def state(options: dict) -> tuple[tuple[int, int], int]:
    """(device, host) bytes of the parameters, masters and states of rank 0's step, and its NVMe bytes."""
    cfg = resolve_config(load_config_file(CONFIG, options), world_size=RANKS)
    with shared_sharding_decisions():
        memory = Tracer(RANKS).step(cfg, count_work=False, approximate=True)
    return model_state(memory), memory.disk_peak_bytes


def test_the_671b_full_fine_tune_fits_no_setting_on_one_node_of_141_gib():
    """Each rank holds an eighth of the 682.6e9 parameters (the MTP layer's 11.6e9 included, the routed experts split
    over expert parallel 8) as fp32 shards. Kept on the device (swap + gradient offload + NVMe) they alone are
    317.9 GiB > 141 GiB; moved to the host (FSDP2's CPU offload policy) with their AdamW states, 953.6 GiB > the 256 GiB
    a rank's share of 2 TiB. The NVMe tier takes the swap optimizer's states only (635.8 GiB a rank), never the
    shards: the answer is 'nothing fits', and every device below 141 GiB (8 x 80 GiB) fails the same way."""
    shard = 4 * parameters() // RANKS
    (device, device_host), disk = state(ON_DEVICE)
    assert device == pytest.approx(shard, rel=1e-4) and device_host == 0
    assert disk == pytest.approx(2 * shard, rel=1e-4)  # AdamW's two fp32 states, in files
    assert over_budget(device, 0, DEVICE, HOST) == [("device", "device peak 317.9 GiB > budget 141.0 GiB")]
    (host_device, host), _ = state(ON_HOST)
    assert host_device < GiB and host == pytest.approx(3 * shard, rel=1e-4)
    assert over_budget(0, host, DEVICE, HOST) == [("host", "host peak 953.6 GiB > budget 256.0 GiB")]
