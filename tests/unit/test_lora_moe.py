"""LoRA on a mixture of experts (docs/lora.md "Mixture of experts"): adapters on the attention and on the dense and
shared-expert MLP linears; the routers, the stacked routed experts and the shared-expert gate stay frozen and
bitwise; 4-bit experts are refused in one line (the experts on the host: test_lora_base_on_host)."""

import pytest
import torch

from internlm_offload.builder import make_trainer
from internlm_offload.config import ConfigError, resolve_config
from internlm_offload.model.lora import adapter_parameters

from test_lora import CTX, base_state, batches, build, native

pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MOE = {"num_experts": 4, "top_k": 2, "moe_type": "GShard", "num_shared_experts": 1, "mlp_ratio": 1.0}


def moe(lora: dict | None = None, **model) -> dict:
    raw = native(lora, **{"loss": {"moe_loss_coeff": 0.01}})
    raw["model"].update(MOE, **model)
    return raw


def test_adapters_sit_on_attention_and_shared_experts_and_the_rest_stays_frozen():
    """Every block's wq/wk/wv/wo and its shared expert's w1/w3/w2 take adapters, nothing under the router or the
    stacked experts; step 0 is the base model; after 3 steps (aux loss on) the base is bitwise the one built."""
    raw = moe({"r": 4, "lora_alpha": 8, "target_modules": ALL}, dtype="torch.float32")
    tokens = batches(1, 259)[0][0]
    base = build(moe(dtype="torch.float32")).model
    parts = build(raw)
    with torch.no_grad():  # logits and aux loss: both the base model's
        ours, theirs = parts.model(tokens), base(tokens)
        assert torch.equal(ours.logits, theirs.logits) and ours.aux_losses.keys() == theirs.aux_losses.keys()
        assert all(torch.equal(ours.aux_losses[name], theirs.aux_losses[name]) for name in ours.aux_losses)
    adapted = {name.split(".lora_")[0] for name, _ in adapter_parameters(parts.model)}
    attention = {f"layers.{i}.attention.{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")}
    shared = {f"layers.{i}.feed_forward.shared_experts.{w}" for i in range(2) for w in ("w1", "w3", "w2")}
    assert adapted == attention | shared
    before = base_state(parts.model)
    assert any(".feed_forward.router." in n for n in before) and any(".feed_forward.experts." in n for n in before)
    trainer = make_trainer(resolve_config(raw), CTX, parts)
    try:
        for batch in batches(3, 259):
            trainer.train_step([batch])
    finally:
        trainer.close()
    after = base_state(parts.model)
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    stepped = {id(p) for group in parts.optimizer.param_groups for p in group["params"]}
    assert stepped == {id(p) for _, p in adapter_parameters(parts.masters.module)}
    assert all(p.abs().sum() > 0 for name, p in adapter_parameters(parts.model) if "lora_B" in name)


def test_experts_in_4_bits_are_refused_in_one_line():
    raw = moe({})
    raw["model"]["quantization_config"] = {"load_in_4bit": True}
    with pytest.raises(ConfigError) as info:
        resolve_config(raw)
    message = "model.quantization_config with model.num_experts=4: the stacked experts are not held in 4 bits yet"
    assert message in str(info.value) and "\n" not in str(info.value)
