"""A LoRA run's exports (tools/export_lora.py): PEFT's adapter folder loads with `PeftModel.from_pretrained` on the
exported base, and the merged folder in transformers, each with this run's logits (fp32, within 1e-5); the
checkpoint holds the adapters only."""

import json

import pytest
import torch
from tiny_configs import TINY_HF_LLAMA

from internlm_offload.builder import build_trainer
from internlm_offload.config import resolve_config
from internlm_offload.device import Accelerator
from internlm_offload.engine.checkpoint import latest_checkpoint
from internlm_offload.engine.checkpoint_reader import read_metadata
from internlm_offload.engine.runtime import RunContext
from internlm_offload.tools.export import main as export

pytest.importorskip("peft")

CTX = RunContext(rank=0, local_rank=0, world_size=1, accelerator=Accelerator("cpu"))
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}
MODELS = {
    "internlm2": {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_kv_attention_heads": 2,
        "lora": {
            **LORA,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        },
    },
    "internlm2_moe": {  # exports as Qwen2-MoE: the MLP adapters sit on its shared expert
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_kv_attention_heads": 2,
        "qkv_bias": True,
        "o_bias": False,
        "num_experts": 4,
        "top_k": 2,
        "moe_type": "Dropless",
        "num_shared_experts": 1,
        "shared_expert_gate": "sigmoid",
        "mlp_ratio": 1.0,
        "lora": {**LORA, "target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]},
    },
    "hf_causal_lm": {
        "type": "hf_causal_lm",
        "hf_config": {**TINY_HF_LLAMA, "tie_word_embeddings": False},
        "lora": {**LORA, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    },
}


def train(raw: dict, folder) -> object:
    """Train `raw` in `folder` on one process; the trainer, closed, with its trained model."""
    folder.mkdir()
    trainer = build_trainer(resolve_config({**raw, "monitor": {"progress_bar": "off"}}), CTX, folder)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


@pytest.mark.parametrize("model", MODELS)
def test_peft_folder_and_merged_weights_give_this_runs_logits(model, tmp_path):
    raw = {"model": MODELS[model], "data": {"seq_len": 32, "total_steps": 3}, "adam": {"lr": 2e-2}}
    trainer = train(raw, tmp_path / "run")
    checkpoint = latest_checkpoint(tmp_path / "run" / "checkpoints")
    saved = [k for k in read_metadata(checkpoint).state_dict_metadata if k.startswith("model.")]
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)  # the base is not copied
    for flags, out in (["--peft"], "adapter"), (["--hf"], "base"), (["--hf", "--merge"], "merged"):
        assert export([str(checkpoint), str(tmp_path / out), *flags]) == 0

    import peft
    from transformers import AutoModelForCausalLM

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    tokens = torch.randint(0, 259, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = trainer.model(tokens).logits
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
        assert all(p.abs().sum() > 0 for n, p in adapted.named_parameters() if "lora_B" in n)  # trained
        torch.testing.assert_close(adapted(input_ids=tokens).logits, ours, rtol=1e-5, atol=1e-5)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        torch.testing.assert_close(merged(input_ids=tokens).logits, ours, rtol=1e-5, atol=1e-5)
        with adapted.disable_adapter():  # the adapters matter: without them the logits differ
            assert not torch.allclose(adapted(input_ids=tokens).logits, ours, rtol=1e-5, atol=1e-5)


def test_merge_needs_a_lora_checkpoint(tmp_path, capsys):
    raw = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}, "data": {"total_steps": 1}}
    train(raw, tmp_path / "run")
    assert export([str(tmp_path / "run" / "checkpoints"), str(tmp_path / "out"), "--peft"]) == 2
    assert "need a LoRA run's checkpoint" in capsys.readouterr().err
