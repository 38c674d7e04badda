"""The kernel probe's one-block copy (builder.model.build_probe_model) is built as the run builds its blocks."""

import torch

from internlm_offload.builder.model import build_probe_model
from internlm_offload.config import load_config_file, resolve_config


def test_lora_probe_block_has_the_runs_adapters_and_draws_nothing() -> None:
    """A LoRA run's probe runs the adapters' kernels (frozen base, trainable A and B), and building it leaves the
    run's random stream where it was."""
    cfg = resolve_config(load_config_file("configs/internlm2_tiny_lora.py", {})).model
    one_block = cfg.model_copy(update={"num_layers": 1})
    torch.manual_seed(0)
    before = torch.get_rng_state()
    model = build_probe_model(one_block)
    assert torch.equal(torch.get_rng_state(), before)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    assert len(trained) == 2 * len(cfg.lora.target_modules)  # A and B on each of the block's seven projections
    assert all(p.device.type == "meta" for p in model.parameters())
