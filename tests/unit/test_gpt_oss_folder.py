"""A GPT-OSS folder made by transformers, from the folder alone (model/families/gpt_oss): transformers' step-1 loss and
grad norm (fp32, one document a row), packed documents each their own (full and sliding layers), LoRA on the
attention as PEFT puts it on transformers' model, the `--hf` folder written back bit for bit, and an MXFP4 folder's
experts dequantised on load (whole and a piece at a time)."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from folder_parity import assert_step_1_matches, step_1_ids
from safetensors.torch import load_file, save_file

from internlm_offload.builder.model import build_model, folder_layout
from internlm_offload.config import ModelConfig
from internlm_offload.model.families.gpt_oss.build import folder_config
from internlm_offload.model.families.gpt_oss.mxfp4 import dequantize
from internlm_offload.weights.hf_folder import folder_pieces, read_folder, write_family_folder

transformers = pytest.importorskip("transformers")

VOCAB = 259
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0}  # fmt: skip
CONFIG = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 32, "head_dim": 16, "num_attention_heads": 4,
          "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 3,
          "sliding_window": 4, "max_position_embeddings": 256, "rope_parameters": YARN}  # fmt: skip


def transformers_folder(folder: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A seeded random GptOssForCausalLM (eager attention: its sinks), norms, biases and sinks made to count, saved."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG, attn_implementation="eager"))
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if key.endswith("norm.weight"):
                tensor.uniform_(0.5, 1.5)
            elif key.endswith(("_bias", "proj.bias")):
                tensor.normal_(0, 0.1)
            elif key.endswith("sinks"):
                tensor.normal_(0, 1.0)
    model.to(dtype).save_pretrained(folder)
    return model


def native(folder: Path) -> torch.nn.Module:
    return build_model(ModelConfig(type="gpt_oss", hf_path=str(folder)), torch.device("cpu"))


def test_step_1_loss_and_grad_norm_are_transformers_from_the_folder_alone(tmp_path):
    reference = transformers_folder(tmp_path / "gpt_oss")
    model = native(tmp_path / "gpt_oss")
    assert_step_1_matches(model, reference, step_1_ids(VOCAB, 24))


def test_two_packed_documents_give_each_its_own_logits(tmp_path):
    """Longer than the window (4): the sliding layers' window stays inside each document."""
    transformers_folder(tmp_path / "gpt_oss")
    model = native(tmp_path / "gpt_oss")
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(12), torch.arange(8)])[None]
    packed = model(ids, positions).logits
    torch.testing.assert_close(packed[:, :12], model(ids[:, :12]).logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[:, 12:], model(ids[:, 12:]).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_hf_folder_is_written_back_bit_for_bit(tmp_path, dtype):
    transformers_folder(tmp_path / "in", dtype)
    cfg = ModelConfig(type="gpt_oss", hf_path=str(tmp_path / "in"))
    model = build_model(cfg, torch.device("cpu"))
    write_family_folder(model.state_dict(), folder_layout(cfg), folder_config(cfg), tmp_path / "out", dtype)
    want, have = load_file(tmp_path / "in" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert have.keys() == want.keys()
    assert all(have[k].dtype == dtype and torch.equal(have[k], want[k]) for k in want), "tensors differ"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ == "GptOssForCausalLM"


def quantised(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's experts replaced by random MXFP4 blocks and scales (as the official release stores them); the
    float experts they stand for."""
    tensors = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    floats = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inner, outer = tensors.pop(name).shape  # (E, in, out)
        blocks = torch.randint(0, 256, (experts, outer, inner // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(122, 128, (experts, outer, inner // 32), dtype=torch.uint8, generator=g)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        floats[name] = dequantize(blocks, scales)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return floats


def test_an_mxfp4_folder_is_dequantised_into_the_stacked_experts(tmp_path):
    folder = tmp_path / "mxfp4"
    transformers_folder(folder, torch.bfloat16)
    floats = quantised(folder)
    cfg = ModelConfig(type="gpt_oss", hf_path=str(folder))
    model = build_model(cfg, torch.device("cpu"))
    experts = model.layers[1].feed_forward.experts
    gate_up, down = floats["model.layers.1.mlp.experts.gate_up_proj"], floats["model.layers.1.mlp.experts.down_proj"]
    assert torch.equal(experts.w1, gate_up[..., 0::2].transpose(1, 2))
    assert torch.equal(experts.w3, gate_up[..., 1::2].transpose(1, 2))
    assert torch.equal(experts.w2, down.transpose(1, 2))
    layout = folder_layout(cfg)
    whole = read_folder(folder, layout)
    pieces = {name: t for piece in folder_pieces(folder, layout) for name, t in piece.items()}
    assert pieces.keys() == whole.keys() and all(torch.equal(pieces[k], whole[k]) for k in whole)
    write_family_folder(model.state_dict(), layout, folder_config(cfg), tmp_path / "out", torch.bfloat16)
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(out["model.layers.1.mlp.experts.gate_up_proj"], gate_up.to(torch.bfloat16))  # exact in bf16


def test_lora_on_the_attention_follows_peft_on_transformers(tmp_path):
    """`model.lora` on q/k/v/o (transformers' names) of a folder: adapters on every block's wq/wk/wv/wo and nowhere
    else (sinks, router and stacked experts frozen); with the same A and B (B drawn nonzero) the loss and every
    adapter's gradient are those of PEFT's `get_peft_model` on transformers' GptOssForCausalLM within 1e-5. Red with
    o_proj mapped to wq (adapters on wq only, none on wo: the adapters' names differ)."""
    peft = pytest.importorskip("peft")
    from internlm_offload.builder.model import add_adapters
    from internlm_offload.model.lora import adapter_parameters

    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    theirs = peft.get_peft_model(transformers_folder(tmp_path / "gpt_oss"), peft.LoraConfig(**lora))
    cfg = ModelConfig(type="gpt_oss", hf_path=str(tmp_path / "gpt_oss"), lora=lora)
    model = build_model(cfg, torch.device("cpu"))
    add_adapters(cfg, model)
    ours = dict(adapter_parameters(model))
    names = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
             "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo"}  # fmt: skip

    def our_name(name: str) -> str:
        name = name.removeprefix("base_model.model.model.")
        for hf, native_name in names.items():
            name = name.replace(hf, native_name)
        return name

    adapters = {our_name(n): p for n, p in theirs.named_parameters() if "lora_" in n}
    assert adapters.keys() == ours.keys() and len(ours) == 3 * 4 * 2
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    with torch.no_grad():
        for name, param in ours.items():
            if "lora_B" in name:
                param.normal_(0, 0.05)
            adapters[name].copy_(param)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    want = theirs(input_ids=ids, labels=ids).loss
    got = F.cross_entropy(model(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for name, param in ours.items():
        torch.testing.assert_close(param.grad, adapters[name].grad, rtol=1e-5, atol=1e-6, msg=name)
