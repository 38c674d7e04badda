"""GLM-5 (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`) folders made by transformers, tiny and random, with
`index_topk` 16 below the 64-token sequence (so the attention is sparse in both): from the folder alone the native model
gives transformers' step-1 loss and grad norm within 1e-5 (fp32), and its export writes the folder's tensors back bit
for bit (the indexers on the blocks that own one, `weights_proj` in fp32). transformers' indexer is frozen as ours is:
neither norm counts it."""

from pathlib import Path

import pytest
import torch
from folder_parity import assert_step_1_matches, next_token_loss, step_1_ids
from safetensors.torch import load_file

from internlm_offload.builder.model import build_model
from internlm_offload.config import ModelConfig
from internlm_offload.model.families.deepseek_v3 import build as deepseek_build
from internlm_offload.weights.hf_folder import write_family_folder

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 259, 64
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 16, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
              "n_routed_experts": 8, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
              "max_position_embeddings": 128, "tie_word_embeddings": False, "q_lora_rank": 16, "kv_lora_rank": 16,
              "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12, "index_topk": 16, "index_n_heads": 8,
              "index_head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}  # fmt: skip
FAMILIES = {
    "glm_moe_dsa": ("GlmMoeDsa", {**COMMON, "indexer_types": ["full", "shared", "full"]}),
    "deepseek_v32": ("DeepseekV32", COMMON),
}


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
                tensor.uniform_(-0.3, 0.3)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_step_1_loss_and_grad_norm_are_transformers_from_the_folder_alone(family, tmp_path):
    reference = transformers_folder(family, tmp_path / family)
    native = build_model(ModelConfig(type="deepseek_v3", hf_path=str(tmp_path / family)), torch.device("cpu"))
    assert sum(".indexer." in n for n, _ in native.named_parameters()) == (10 if family == "glm_moe_dsa" else 15)
    ids = step_1_ids(VOCAB, SEQ)
    got = assert_step_1_matches(native, reference, ids)
    # the top-k matters at this length: with every key chosen the loss is another
    for layer in native.layers:
        layer.attention.topk = SEQ
    with torch.no_grad():
        dense = next_token_loss(native, ids)
    assert (dense - got).abs() > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_export_writes_the_folders_tensors_back_bit_for_bit(family, tmp_path):
    transformers_folder(family, tmp_path / "in")
    section = ModelConfig(type="deepseek_v3", hf_path=str(tmp_path / "in"), mtp_config={"num_layers": 0})
    native = build_model(section, torch.device("cpu"))
    layout = deepseek_build.folder_format(native)
    write_family_folder(
        native.state_dict(), layout, deepseek_build.folder_config(section), tmp_path / "out", torch.float32
    )
    want, got = load_file(tmp_path / "in" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert any(".indexer.weights_proj." in k for k in got)
    reloaded = getattr(transformers, f"{FAMILIES[family][0]}ForCausalLM").from_pretrained(tmp_path / "out")
    assert reloaded.config.model_type == family
