"""InternEvo's mixture-of-experts configs: their model types and MoE keys map onto the native MoE blocks, with
each family's switches; the expert-parallel sections are read as written; what cannot run is one line each."""

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from internlm_offload.builder.model import build_model
from internlm_offload.config import ConfigError, load_config_file, resolve_config
from internlm_offload.model.moe import MoE

DATA = Path(__file__).resolve().parents[1] / "data"
# InternEvo's five MoE configs (develop, 2025), their keys as shipped, shrunk in size only.
MOE4 = DATA / "internevo_7b_moe4_sft_shrunk.py"
MOE16 = DATA / "internevo_1p8b_moe16_sft_shrunk.py"
MIXTRAL = DATA / "internevo_8x7b_mixtral_shrunk.py"
QWEN2 = DATA / "internevo_57b_qwen2_moe_shrunk.py"
QWEN3 = DATA / "internevo_qwen3_30b_a3b_shrunk.py"


def refusal(raw: dict[str, Any], world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_config(raw, world_size=world_size)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# (file, num_experts, top_k, moe_type, shared experts, shared gate, (qkv bias, o bias), qk_norm, head_dim, coeff)
FAMILIES = [
    (MOE4, 4, 2, "GShard", 0, "softmax", (True, True), False, None, 0.1),
    (MOE16, 16, 1, "GShard", 0, "softmax", (True, True), False, None, 0.1),
    (MIXTRAL, 8, 2, "GShard", 0, "softmax", (False, False), False, None, 0.02),
    (QWEN2, 16, 8, "GShard", 8, "sigmoid", (True, False), False, None, 0.001),
    (QWEN3, 16, 8, "Dropless", 0, "sigmoid", (True, False), True, 32, 0.001),
]


@pytest.mark.parametrize("path, experts, top_k, moe_type, shared, gate, biases, qk_norm, head_dim, coeff", FAMILIES)
def test_each_family_builds_its_internevo_layer(
    path, experts, top_k, moe_type, shared, gate, biases, qk_norm, head_dim, coeff
):
    """What InternEvo's class for the config's model_type builds, here: the MoE keys as written, the family's
    attention biases (class defaults where the config is silent), shared-expert gate, q/k norm and head_dim."""
    cfg = resolve_config(load_config_file(path))
    m = cfg.model
    assert (m.type, m.num_experts, m.top_k, m.moe_type, m.num_shared_experts) == (
        "internlm2",
        experts,
        top_k,
        moe_type,
        shared,
    )
    assert (m.shared_expert_gate, m.qk_norm, m.head_dim, cfg.loss.moe_loss_coeff) == (gate, qk_norm, head_dim, coeff)
    assert cfg.parallel.mode == "none"
    model = build_model(m, torch.device("meta"))
    block = model.layers[0]
    attention, moe = block.attention, block.feed_forward
    assert isinstance(moe, MoE) and moe.experts.w1.shape[0] == experts and moe.top_k == top_k
    assert ((attention.wq.bias is not None), (attention.wo.bias is not None)) == biases
    assert (attention.q_norm is not None) == qk_norm and moe.drop_tokens == (moe_type == "GShard")
    # Mixtral's and InternLM-MoE's GShard (InternEvo's fused gating) and Qwen3's Dropless all renormalise the top-k
    assert moe.router.normalize_weights and moe.router.scoring_func == "softmax"
    if shared:
        assert moe.coefficient.weight.shape == ((1, m.hidden_size) if gate == "sigmoid" else (2, m.hidden_size))
    assert model.args.aux_loss_by_layer == (path != QWEN3)  # Qwen: one loss from all layers' router logits


def test_moe16_takes_internevos_top_k_default_and_width_rounding():
    cfg = resolve_config(load_config_file(MOE16))
    assert cfg.model.multiple_of == 128 and cfg.model.num_shared_experts == 0  # moe_use_residual=False


def test_qwen2_gshard_trains_as_shipped_with_a_warning():
    """57B_qwen2_MoE.py's moe_type='GShard': trained as GShard (InternEvo's Qwen2-MoE when it shipped), said once."""
    cfg = resolve_config(load_config_file(QWEN2))
    _, warnings = cfg.migration_notes()
    assert any("moe_type='GShard' with model_type='QWEN2MOE': trained as GShard" in line for line in warnings)
    raw = load_config_file(QWEN2)
    raw["model"]["moe_type"] = "Dropless"  # as InternEvo's develop decoder asserts: one global aux loss
    cfg = resolve_config(raw)
    assert cfg.model.moe_type == "Dropless" and cfg.model.moe_layer_kwargs.aux_loss_by_layer is False


def test_expert_parallel_size_minus_one_resolves_as_internevo_and_says_so():
    """InternEvo's default expert size -1 (and <= 0): min(data-parallel ranks, experts), said in the log."""
    raw = load_config_file(MOE4)
    raw["model"]["dtype"] = "torch.float32"
    cfg = resolve_config(copy.deepcopy(raw), world_size=2)
    notes, _ = cfg.migration_notes()
    line = next(n for n in notes if "parallel.expert.size=-1" in n)
    assert cfg.parallel.expert.size == 2 and "-> 2: min(data-parallel ranks 2, model.num_experts 4)" in line
    assert resolve_config(copy.deepcopy(raw), world_size=8).parallel.expert.size == 4  # min(8, 4)
    raw["parallel"]["expert"] = dict(size=0)
    assert resolve_config(copy.deepcopy(raw), world_size=2).parallel.expert.size == 2
    assert resolve_config(load_config_file(MOE4), world_size=2).parallel.expert.size == 2  # as shipped: bf16
    raw["parallel"]["zero1"] = dict(size=-1, fsdp=True)
    raw["parallel"]["fsdp_cpu_offload"] = True  # FSDP2's CPU offload policy takes the expert shards too
    assert resolve_config(copy.deepcopy(raw), world_size=2).parallel.expert.size == 2


def test_first_k_dense_replace_and_num_experts_one():
    raw = load_config_file(MOE4)
    raw["model"]["first_k_dense_replace"] = 1
    assert resolve_config(copy.deepcopy(raw)).model.mlp_only_layers == [0]
    raw["model"]["num_experts"] = 1  # InternEvo: <= 1 is a dense FFN
    assert resolve_config(raw).model.num_experts == 0


def test_layer_kwargs_without_effect_are_ignored_by_name():
    raw = load_config_file(MOE4)
    raw["model"]["moe_layer_kwargs"] = dict(
        capacity_factor=1.25, eval_capacity_factor=1.25, use_fused_gating=True, use_rts=True, use_grouped_mlp=True
    )
    cfg = resolve_config(raw)
    assert cfg.model.moe_layer_kwargs.capacity_factor == 1.25
    notes, _ = cfg.migration_notes()
    ignored = next(n for n in notes if n.startswith("InternEvo keys without effect"))
    assert "model.moe_layer_kwargs.use_fused_gating" in ignored and "eval_capacity_factor=1.25" in ignored


def test_drop_tokens_false_is_honoured_and_the_difference_said():
    """InternEvo's fused gating (its default) ignores drop_tokens=False; here it computes every choice: a warning."""
    raw = load_config_file(MOE4)
    raw["model"]["moe_layer_kwargs"] = dict(drop_tokens=False)
    cfg = resolve_config(raw)
    assert cfg.model.moe_layer_kwargs.drop_tokens is False
    _, warnings = cfg.migration_notes()
    assert any("drop_tokens=False: InternEvo's default fused gating ignores it" in line for line in warnings)


def _with(path: Path, **changes: Any) -> dict[str, Any]:
    raw = load_config_file(path)
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        target = raw.setdefault(section, {}) if section != "top" else raw
        target[key] = value
    return raw


@pytest.mark.parametrize(
    "raw, part",
    [
        (
            _with(QWEN3, parallel__expert=dict(size=8, no_tp=True)),
            "parallel.expert.size=8 must divide the data-parallel size (1)",
        ),
        (
            _with(QWEN3, parallel__expert_weight=dict(size=2, overlap=True)),
            "parallel.expert_weight.size=2 needs parallel.expert.size > 1; set 1",
        ),
        (
            _with(QWEN3, model__moe_type="GShard", model__moe_layer_kwargs={}),
            "model.moe_type='GShard' with model_type='QWEN3MOE': InternEvo's Qwen3-MoE decoder asserts Dropless",
        ),
        (
            _with(QWEN3, model__moe_layer_kwargs=dict(capacity_factor=1.0, aux_loss_by_layer=False)),
            "model.moe_layer_kwargs.capacity_factor=1.0 with moe_type='Dropless'",
        ),
        (
            _with(QWEN3, model__moe_layer_kwargs=dict(aux_loss_by_layer=True)),
            "model.moe_layer_kwargs.aux_loss_by_layer=True: InternEvo's QWEN3MOE model computes one loss",
        ),
        (_with(MOE4, model__moe_layer_kwargs=dict(use_fused_gating=False)), "use_fused_gating=False"),
        (_with(MOE4, model__moe_layer_kwargs=dict(noisy_gate_policy="RSample")), "noisy_gate_policy='RSample'"),
        (_with(MOE4, top__moe=dict(top_k=2)), "moe=dict(...): InternEvo's older MoE section is not read"),
        (_with(MOE4, model__moe_type="MegaBlock-D"), "model.moe_type='MegaBlock-D': supported here"),
    ],
)
def test_what_cannot_run_is_one_line(raw, part):
    assert part in refusal(raw)


@pytest.mark.parametrize("mode", ["mtp", "msp", "fsp"])
def test_every_column_row_tensor_mode_with_moe_takes_either_no_tp(mode):
    """Tensor size 2 on an MoE model: mtp/msp/fsp with the config's no_tp=False split every expert over the tensor
    group (expert size -1: min(data-parallel ranks, 4 experts)); with no_tp=True they stay whole, each
    tensor rank routing its own sequence chunk (expert size -1: min(every rank, 4 experts)); isp keeps them whole
    either way (InternEvo's isp does the same)."""
    split = _with(MOE4, parallel__tensor=dict(size=2, mode=mode))
    split["parallel"]["zero1"] = dict(size=-1, fsdp=True)
    assert resolve_config(split, world_size=4).parallel.expert.size == 2
    whole = _with(MOE4, parallel__tensor=dict(size=2, mode=mode), parallel__expert=dict(size=-1, no_tp=True))
    whole["parallel"]["zero1"] = dict(size=-1, fsdp=True)  # FSDP2: DDP takes no tensor-parallel DTensors
    assert resolve_config(whole, world_size=2).parallel.expert.size == 2
    isp = resolve_config(_with(MOE4, parallel__tensor=dict(size=2, mode="isp")), world_size=2)
    assert isp.parallel.expert.size == 2  # -1: min(every rank, 4 experts)


def test_qwen3_parallel_section_as_shipped_resolves_at_sizes_that_divide_the_world() -> None:
    """qwen3_30B_A3B.py's isp of size 1 with weight, expert and expert_weight groups: FSDP2 (weight parallel maps onto
    FSDP2 over all ranks), expert parallel with its experts sharded over groups of expert-data ranks. Expert weight
    groups alone (weight 1) ask for FSDP2 too: DDP has no sharding to group."""
    for weight in (2, 1):
        raw = _with(QWEN3, parallel__weight=dict(size=weight, overlap=True), parallel__expert=dict(size=2, no_tp=True))
        raw["parallel"]["expert_weight"] = dict(size=2, overlap=True)
        cfg = resolve_config(raw, world_size=8)
        assert cfg.parallel.mode == "fsdp2", weight
        assert (cfg.parallel.expert.size, cfg.parallel.expert_weight.size) == (2, 2)


def test_shipped_expert_sizes_exit_2_in_one_line(capsys: Any) -> None:
    """qwen3_30B_A3B.py's own expert and expert-weight sizes (8, 2) on one process stop train.py with exit code 2 in
    one line."""
    from internlm_offload import launch

    options = ["parallel.expert.size=8", "parallel.expert_weight.size=2"]
    assert launch.main(["--config", str(QWEN3), "--cfg-options", *options], build_trainer=None) == 2
    err = capsys.readouterr().err
    assert "parallel.expert.size=8 must divide the data-parallel size (1)" in err and err.count("\n") == 1
