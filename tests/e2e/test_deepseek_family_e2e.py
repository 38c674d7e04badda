"""The DeepSeek-V3 lineage as a native family (model/families/deepseek_v3): tiny random DeepSeek-V3 (MLA, group-
limited routing), GLM-4.7-Flash (MLA, `mlp_layer_types`) and GLM-4.5 (grouped-query attention with partial RoPE,
q/k norms and biases) folders made by transformers give transformers' step-1 loss and grad norm from the folder
alone, and a config naming the folder trains, its router biases moved once a step by the rule. Their config.json asks
for a multi-token-prediction layer (transformers' default num_nextn_predict_layers=1, not GLM-4.7-Flash's class),
which transformers' folder lacks: the model builds it from the seed, and the parity below scores the logits alone
(transformers' loss has no MTP term), so the MTP layer gets no gradient and the norm is the main model's."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from runner import TINY, metrics, train

from internlm_offload.builder.model import build_model
from internlm_offload.config import ModelConfig

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

VOCAB = 259  # the byte tokenizer's
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, n_shared_experts=1, num_experts_per_tok=2, norm_topk_prob=True,
              max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
FAMILIES = {
    "deepseek_v3": ("DeepseekV3", {**COMMON, **MLA, "num_key_value_heads": 4, "n_routed_experts": 8, "n_group": 4,
                                   "topk_group": 2, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1}),
    "glm4_moe_lite": ("Glm4MoeLite", {**COMMON, **MLA, "num_key_value_heads": 4, "n_routed_experts": 8, "n_group": 1,
                                      "topk_group": 1, "routed_scaling_factor": 1.8,
                                      "mlp_layer_types": ["dense", "sparse", "sparse"]}),
    "glm4_moe": ("Glm4Moe", {**COMMON, "num_key_value_heads": 2, "head_dim": 16, "n_routed_experts": 8, "n_group": 1,
                             "topk_group": 1, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
                             "use_qk_norm": True, "attention_bias": True,
                             "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                                 "rope_type": "default"}}),
}  # fmt: skip


def transformers_folder(family: str, folder: Path) -> torch.nn.Module:
    """A seeded random transformers model of `family`, its norms and router biases made to count, saved."""
    name, config = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(getattr(transformers, f"{name}Config")(**config))
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if key.endswith("norm.weight"):
                tensor.uniform_(0.5, 1.5)
            elif key.endswith("e_score_correction_bias"):
                tensor.uniform_(-0.3, 0.3)  # big enough to change choices: the bias must pick, not weigh
    model.save_pretrained(folder)
    return model


def grad_norm(model: torch.nn.Module) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))


@pytest.mark.parametrize("family", FAMILIES)
def test_step_1_loss_and_grad_norm_are_transformers_from_the_folder_alone(family, tmp_path):
    reference = transformers_folder(family, tmp_path / family)
    native = build_model(ModelConfig(type="deepseek_v3", hf_path=str(tmp_path / family)), torch.device("cpu"))
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    want = reference(ids, labels=ids).loss
    logits = native(ids).logits
    got = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad_norm(native), grad_norm(reference), rtol=0, atol=1e-5)


def test_a_config_naming_the_folder_trains_and_moves_the_router_bias(tmp_path):
    transformers_folder("deepseek_v3", tmp_path / "ds")
    config = tmp_path / "ds.py"
    config.write_text(f"_base_ = [{str(TINY)!r}]\nmodel = dict(type='deepseek_v3', hf_path={str(tmp_path / 'ds')!r})\n")
    train(tmp_path / "run", "data.total_steps=3", config=config)
    steps = metrics(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(0 < r["loss"] < 10 and r["moe_maxvio"] >= 0 for r in steps)
