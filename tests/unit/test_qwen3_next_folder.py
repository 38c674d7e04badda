"""A Qwen3-Next or Qwen3.5-MoE text folder made by transformers, from the folder alone (model/families/qwen3_next): transformers' step-1
loss and grad norm (fp32, one document a row), packed documents each their own, the `--hf` folder written back bit
for bit."""

from pathlib import Path

import pytest
import torch
from folder_parity import assert_step_1_matches, step_1_ids
from safetensors.torch import load_file

from internlm_offload.builder.model import build_model, folder_layout
from internlm_offload.config import ModelConfig
from internlm_offload.model.families.qwen3_next.build import folder_config
from internlm_offload.weights.hf_folder import write_family_folder

transformers = pytest.importorskip("transformers")

VOCAB = 259
# 4 layers: 3 Gated DeltaNet then 1 gated full attention
CONFIG = {"vocab_size": VOCAB, "hidden_size": 64, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 40, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
          "linear_value_head_dim": 8, "max_position_embeddings": 256}  # fmt: skip
# Qwen3-Next: fused DeltaNet projections, block 1 dense; Qwen3.5-MoE's text model: split projections, every block sparse
KINDS = {
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", {"intermediate_size": 48, "mlp_only_layers": [1]}),
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", {}),
}


def transformers_folder(folder: Path, dtype: torch.dtype = torch.float32, kind: str = "qwen3_next") -> torch.nn.Module:
    """A seeded random causal LM of `kind` (sdpa attention), its zero-init norms made to count, saved."""
    torch.manual_seed(0)
    model_class, config_class, extra = KINDS[kind]
    config = getattr(transformers, config_class)(**CONFIG, **extra, attn_implementation="sdpa")
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if key.endswith("norm.weight"):
                tensor.uniform_(-0.5, 0.5)
    model.to(dtype).save_pretrained(folder)
    return model


def native(folder: Path) -> torch.nn.Module:
    return build_model(ModelConfig(type="qwen3_next", hf_path=str(folder)), torch.device("cpu"))


@pytest.mark.parametrize("kind", KINDS)
def test_step_1_loss_and_grad_norm_are_transformers_from_the_folder_alone(tmp_path, kind):
    """70 tokens a row: two chunks of the delta rule."""
    reference = transformers_folder(tmp_path / "q", kind=kind)
    model = native(tmp_path / "q")
    assert_step_1_matches(model, reference, step_1_ids(VOCAB, 70))


@pytest.mark.parametrize("kind", KINDS)
def test_two_packed_documents_give_each_its_own_logits(tmp_path, kind):
    transformers_folder(tmp_path / "q", kind=kind)
    model = native(tmp_path / "q")
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(12), torch.arange(8)])[None]
    packed = model(ids, positions).logits
    torch.testing.assert_close(packed[:, :12], model(ids[:, :12]).logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[:, 12:], model(ids[:, 12:]).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("kind", "dtype"), [("qwen3_next", torch.float32), ("qwen3_next", torch.bfloat16),
                                             ("qwen3_5_moe_text", torch.bfloat16)])  # fmt: skip
def test_the_hf_folder_is_written_back_bit_for_bit(tmp_path, kind, dtype):
    transformers_folder(tmp_path / "in", dtype, kind)
    cfg = ModelConfig(type="qwen3_next", hf_path=str(tmp_path / "in"))
    model = build_model(cfg, torch.device("cpu"))
    write_family_folder(model.state_dict(), folder_layout(cfg), folder_config(cfg), tmp_path / "out", dtype)
    want, have = load_file(tmp_path / "in" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert have.keys() == want.keys()
    assert all(have[k].dtype == dtype and torch.equal(have[k], want[k]) for k in want), "tensors differ"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ == KINDS[kind][0]


def test_what_is_not_built_is_refused_in_one_line():
    from internlm_offload.config import ConfigError, resolve_config

    model = {"type": "qwen3_next", "hf_config": {"model_type": "qwen3_next"}, "lora": {"r": 8}}
    with pytest.raises(ConfigError, match="model.lora is built for model.type=.*; not 'qwen3_next'"):
        resolve_config({"model": model})
