"""The memory planner prices Muon (docs/planner.md, Muon): its one fp32 state per matrix in every tier, its
Newton-Schulz FLOPs on the device or on the host, the bf16 gathers of whole matrices under FSDP2 and tensor
parallel, and the search never switches AdamW to Muon."""

from pathlib import Path

import pytest

from internlm_offload.builder.model import build_probe_model
from internlm_offload.builder.optimizer import run_param_groups
from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.optim.adamw_rule import ADAMW as ADAMW_RULE
from internlm_offload.optim.memory import groups_state_bytes
from internlm_offload.optim.muon_rule import MUON, block_shapes
from internlm_offload.optim.rules import RULE_KEY
from internlm_offload.planner.compose import trace_composed
from internlm_offload.planner.cost import HARDWARE, StepWork, step_time
from internlm_offload.planner.knobs import OPTIMIZER, Space, settings_on
from internlm_offload.planner.trace import trace_step

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ADAMW, MUON_CONFIG = CONFIGS / "internlm2_tiny.py", CONFIGS / "internlm2_tiny_muon.py"
FAST = {"data.seq_len": 32, "data.micro_bsz": 4, "data.micro_num": 2}
# Where the states live: the device, the host (swap), the NVMe file (swap + nvme)
TIERS = {
    "device": ({}, "optimizer_states"),
    "host": ({"swap_optimizer": True}, "host_optimizer_states"),
    "disk": ({"swap_optimizer": True, "nvme_offload.enable": True}, "disk_optimizer_states"),
}


def config(path: Path, world_size: int = 1, **options):
    return resolve_config(load_config_file(path, {**FAST, **options}), world_size=world_size)


def muon_groups(cfg):
    return [g for g in run_param_groups(cfg, build_probe_model(cfg.model)) if g.get(RULE_KEY) == MUON.name]


def newton_schulz_flops(cfg) -> int:
    """torch's Newton-Schulz per [n, m] matrix (n <= m): per step X Xᵀ (2 n² m), B = bA + cA² (2 n³), BX (2 n² m)."""
    total = 0
    for group in muon_groups(cfg):
        for param in group["params"]:
            for rows, cols in block_shapes(param.shape, group.get("row_splits")):
                n, m = min(rows, cols), max(rows, cols)
                total += group["ns_steps"] * (4 * n * n * m + 2 * n**3)
    return total


@pytest.mark.parametrize("tier", TIERS)
def test_composed_state_bytes_are_each_groups_rules_and_about_half_of_adamws(tier, tmp_path):
    options, component = TIERS[tier]
    if tier == "disk":
        options = {**options, "nvme_offload.path": str(tmp_path)}
    adamw, muon = (trace_composed(config(path, **options)).components[component] for path in (ADAMW, MUON_CONFIG))
    cfg = config(MUON_CONFIG)
    model = build_probe_model(cfg.model)
    groups = run_param_groups(cfg, model)
    _, expected = groups_state_bytes(groups, ADAMW_RULE, {MUON.name: MUON})
    # Muon's matrices 4 B per element, the embedding, head and norms AdamW's 8; beyond them AdamW's step counts
    # and, on the host and disk, the swap arena's alignment (1.5 KB)
    assert expected <= muon <= expected * 1.001, (muon, expected)
    assert 0.5 < muon / adamw < 0.56, (muon, adamw)  # tiny's embedding and head are 8 % of its parameters


def test_newton_schulz_flops_are_counted_on_the_device_and_on_the_host_for_the_hybrids_cpu_share():
    on_device = trace_step(config(MUON_CONFIG)).optimizer_work
    flops = newton_schulz_flops(config(MUON_CONFIG))
    assert on_device.flops == flops and on_device.host_flops == 0
    muon_elements = sum(p.numel() for g in muon_groups(config(MUON_CONFIG)) for p in g["params"])
    assert on_device.device_muon_elements == muon_elements
    all_on_host = {"hybrid_optimizer.enable": True, "hybrid_optimizer.offload_fraction": 1.0}
    on_host = trace_step(config(MUON_CONFIG, **all_on_host)).optimizer_work
    assert on_host.host_flops == flops and on_host.host_muon_elements == muon_elements
    half = trace_step(
        config(MUON_CONFIG, **{"hybrid_optimizer.enable": True, "hybrid_optimizer.offload_fraction": 0.5})
    ).optimizer_work
    assert 0 < half.host_flops < flops and half.host_muon_elements + half.device_muon_elements == muon_elements
    # priced: Newton-Schulz's FLOPs at the device's rate, the host's share at the host's
    hw = HARDWARE["h100"]
    adamw = trace_step(config(ADAMW)).optimizer_work
    extra = step_time(StepWork(), on_device, 1, hw).optimizer_s - step_time(StepWork(), adamw, 1, hw).optimizer_s
    assert extra == pytest.approx(flops / hw.flops_per_s - muon_elements * 8 / hw.hbm_bytes_per_s, rel=1e-6)
    host_s = step_time(StepWork(), on_host, 1, hw).optimizer_s
    assert host_s >= flops / hw.cpu_flops_per_s


@pytest.mark.parametrize("layout", [{"parallel.mode": "fsdp2"}, {"parallel.tensor.size": 2}], ids=["fsdp2", "tp2"])
def test_whole_matrix_gathers_are_priced_in_bf16(layout):
    """Each rank gathers every sharded Muon matrix whole in bf16: (n-1)/n of 2 B per element sent over 2 ranks."""
    cfg = config(MUON_CONFIG, 2, **layout)
    work = trace_step(cfg, 2).optimizer_work
    muon_elements = sum(p.numel() for g in muon_groups(cfg) for p in g["params"])
    assert work.collective_bytes >= muon_elements * 2 // 2
    adamw = trace_step(config(ADAMW, 2, **layout), 2).optimizer_work
    assert work.collective_bytes - adamw.collective_bytes == muon_elements * 2 // 2
    assert work.flops == newton_schulz_flops(cfg)  # every rank orthogonalises every matrix


@pytest.mark.parametrize("path", [ADAMW, MUON_CONFIG], ids=["adamw", "muon"])
def test_the_search_never_changes_the_update_rule(path):
    """The optimizer axis moves states between tiers; `optimizer.*` is no knob: Muon changes the training."""
    cfg = config(path)
    settings = settings_on(OPTIMIZER, Space(cfg))
    assert settings and not any(key.startswith("optimizer") for s in settings for key in s.options)
    assert settings[0].name == ("Muon" if path == MUON_CONFIG else "AdamW")
    with pytest.raises(Exception, match="optimizer.type"):
        config(path, **{"optimizer.type": "auto"})
