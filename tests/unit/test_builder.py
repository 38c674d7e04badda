"""The builder's layer plan: disabled or zero-layer offload changes nothing at all."""

import pytest
import torch

from internlm_offload.builder import apply_layer_plan, build_layer_plan
from internlm_offload.config import resolve_config
from internlm_offload.device import Accelerator
from internlm_offload.model import InternLM2


def tiny_model() -> InternLM2:
    torch.manual_seed(0)
    return InternLM2(num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=259)


@pytest.mark.parametrize("offloading", [dict(enable=False, num_layers=0), dict(enable=True, num_layers=0)])
def test_no_offload_installs_nothing(offloading):
    cfg = resolve_config({"model": {"num_layers": 4, "hidden_size": 64}, "cpu_offloading": offloading})
    model = tiny_model()
    plan = build_layer_plan(cfg, len(model.layers))
    offloader, selective = apply_layer_plan(model.layers, plan, cfg.cpu_offloading, Accelerator("cpu"))
    assert offloader is None and selective is None
    for layer in model.layers:
        assert not layer._forward_pre_hooks and not layer._forward_hooks


def test_plan_applies_every_mode():
    raw = {
        "model": {"num_layers": 4, "hidden_size": 64, "checkpoint": 1.0},
        "cpu_offloading": {"enable": True, "num_layers": 1},
        "selective_checkpoint": True,
        "selective_checkpoint_offload": True,
    }
    cfg = resolve_config(raw)
    model = tiny_model()
    plan = build_layer_plan(cfg, len(model.layers))
    assert [m.value for m in plan.modes] == ["offload", "selective+offload", "selective+offload", "selective+offload"]
    offloader, selective = apply_layer_plan(model.layers, plan, cfg.cpu_offloading, Accelerator("cpu"))
    assert offloader is not None and offloader.num_layers == 1 and selective is not None
