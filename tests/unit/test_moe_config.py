"""The mixture-of-experts and attention keys of the model section: what they build, and one line (exit 2) for each
value they refuse."""

from pathlib import Path
from typing import Any

import pytest
import torch

from internlm_offload import launch
from internlm_offload.builder.model import aux_loss_coefficients, build_model
from internlm_offload.config import ConfigError, load_config_file, resolve_config
from internlm_offload.model.moe import MoE

REPO = Path(__file__).resolve().parents[2]
MOE = {"num_experts": 4, "top_k": 2}


def config_error(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_config(raw)
    message = str(info.value)
    assert "\n" not in message and message, message
    return message


def test_tiny_moe_config_builds_sparse_blocks_with_its_coefficient() -> None:
    cfg = resolve_config(load_config_file(str(REPO / "configs/internlm2_tiny_moe.py")))
    model = build_model(cfg.model, torch.device("cpu"))
    moes = model.moe_layers()
    assert len(moes) == cfg.model.num_layers and aux_loss_coefficients(cfg, model) == {"moe_aux": 0.01}
    assert moes[0].experts.w1.shape == (4, 128, 128) and moes[0].shared_experts.w1.weight.shape == (128, 128)
    assert moes[0].drop_tokens and moes[0].min_capacity == 4


def test_keys_reach_the_model() -> None:
    raw = {
        "model": {
            **MOE,
            "moe_type": "Dropless",
            "num_layers": 3,
            "mlp_only_layers": [0],
            "dense_intermediate_size": 96,
            "moe_use_residual": True,
            "shared_expert_gate": "sigmoid",
            "head_dim": 48,
            "qk_norm": True,
            "qkv_bias": True,
            "o_bias": False,
            "moe_layer_kwargs": {"scoring_func": "sigmoid", "routed_scaling_factor": 2.0, "aux_loss_by_layer": False},
        }
    }
    cfg = resolve_config(raw)
    assert cfg.model.num_shared_experts == 1  # InternEvo's legacy moe_use_residual=True
    model = build_model(cfg.model, torch.device("cpu"))
    dense, sparse = model.layers[0], model.layers[1]
    assert not isinstance(dense.feed_forward, MoE) and dense.feed_forward.w1.weight.shape == (96, 128)
    moe = sparse.feed_forward
    assert (
        moe.router.scoring_func == "sigmoid" and moe.router.scaling_factor == 2.0 and not model.args.aux_loss_by_layer
    )
    assert moe.shared_expert_gate == "sigmoid" and moe.coefficient.weight.shape == (1, 128)
    attn = sparse.attention
    assert attn.head_dim == 48 and attn.q_norm is not None and attn.wq.bias is not None and attn.wo.bias is None


def test_head_dim_frees_hidden_from_heads() -> None:
    """With head_dim, hidden_size need not divide by the heads (Qwen3-30B-A3B: 2048 / 32 = 64, heads of 128)."""
    assert resolve_config({"model": {"hidden_size": 100, "num_attention_heads": 3, "head_dim": 32}}).model.head_dim
    assert "model.hidden_size=100 must be divisible" in config_error(
        {"model": {"hidden_size": 100, "num_attention_heads": 3}}
    )


@pytest.mark.parametrize(
    "model, part",
    [
        ({**MOE, "moe_type": "MegaBlock-D"}, "model.moe_type='MegaBlock-D': supported here: GShard, Dropless"),
        ({**MOE, "moe_type": "MegaBlock"}, "model.moe_type='MegaBlock': supported here: GShard, Dropless"),
        ({"num_experts": 2, "top_k": 3}, "model.top_k=3 must be <= model.num_experts=2"),
        (
            {**MOE, "moe_type": "Dropless", "moe_layer_kwargs": {"capacity_factor": 1.25}},
            "model.moe_layer_kwargs.capacity_factor is a moe_type='GShard' option",
        ),
        (
            {**MOE, "moe_layer_kwargs": {"scoring_func": "sigmoid"}},
            "model.moe_layer_kwargs.scoring_func is a moe_type='Dropless' option",
        ),
        ({**MOE, "moe_layer_kwargs": {"capacity_factor": 0}}, "model.moe_layer_kwargs.capacity_factor"),
        ({**MOE, "moe_layer_kwargs": {"use_tutel": True}}, "model.moe_layer_kwargs.use_tutel"),
        ({**MOE, "mlp_only_layers": [4]}, "model.mlp_only_layers=[4]: 4 is not a block in [0, 4)"),
        ({"num_experts": -1}, "model.num_experts"),
        ({"head_dim": 7}, "model.head_dim"),
    ],
)
def test_bad_values_are_one_line(model: dict, part: str) -> None:
    assert part in config_error({"model": model})


def test_moe_under_mtp_takes_either_no_tp() -> None:
    """mtp with InternEvo's no_tp=False (its default: experts split over the tensor group,
    engine/expert_tensor_parallel.py) resolves, as does no_tp=True (engine/moe_tensor_parallel.py)."""
    raw = {"model": MOE, "parallel": {"tensor": {"size": 2, "mode": "mtp"}}}
    assert not resolve_config(raw, world_size=2).parallel.expert.no_tp
    raw["parallel"]["expert"] = {"no_tp": True}
    assert resolve_config(raw, world_size=2).parallel.expert.no_tp


def test_moe_type_refusal_exits_2(capsys: Any) -> None:
    argv = ["--config", str(REPO / "configs/internlm2_tiny_moe.py"), "--cfg-options", "model.moe_type=MegaBlock-D"]
    assert launch.main(argv, build_trainer=None) == 2
    err = capsys.readouterr().err.strip()
    assert "model.moe_type='MegaBlock-D': supported here: GShard, Dropless" in err and "\n" not in err, err


def test_a_dumped_moe_config_validates_again() -> None:
    """Checkpoints store `model_dump()`, every moe_layer_kwargs key included: the other type's keys at their defaults
    are no option taken, so export and resume read it back."""
    for moe_type in ("GShard", "Dropless"):
        cfg = resolve_config({"model": {**MOE, "moe_type": moe_type}})
        assert resolve_config({"model": cfg.model.model_dump()}).model == cfg.model
