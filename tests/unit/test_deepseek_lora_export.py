"""A LoRA run of the DeepSeek-V3 lineage (model.type='deepseek_v3') exports as the folder it reads: PEFT's adapter
folder under transformers' module names loads with `PeftModel.from_pretrained` on the `--hf` base, and the merged
folder in transformers, each with this run's logits (fp32, within 1e-5): MLA's projections (DeepSeek-V3, from a
folder) and GLM-4.5's grouped-query attention (from `model.hf_config`)."""

import json

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig

from internlm_offload.builder import build_trainer
from internlm_offload.config import resolve_config
from internlm_offload.device import Accelerator
from internlm_offload.engine.checkpoint import latest_checkpoint
from internlm_offload.engine.runtime import RunContext
from internlm_offload.tools.export import main as export

peft = pytest.importorskip("peft")

CTX = RunContext(rank=0, local_rank=0, world_size=1, accelerator=Accelerator("cpu"))
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}
SMALL = dict(vocab_size=259, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
             first_k_dense_replace=1, tie_word_embeddings=False)  # fmt: skip
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
# case -> (LoRA targets by the family's module names, PEFT's target_modules). Attention only: PEFT reads a
# `gate_proj` / `up_proj` / `down_proj` target of these MoE models as transformers' fused experts (`mlp.experts`), not
# the dense or shared-expert module the adapter sits on (seen with the installed PEFT), whatever the export names.
CASES = {
    "deepseek_v3": (["q_a_proj", "kv_b_proj", "o_proj"], ["kv_b_proj", "o_proj", "q_a_proj"]),
    "glm4_moe": (["wq", "wv", "wo"], ["o_proj", "q_proj", "v_proj"]),
}


def model_section(case: str, tmp_path) -> dict:
    if case == "deepseek_v3":
        torch.manual_seed(0)
        DeepseekV3ForCausalLM(DeepseekV3Config(**SMALL, **MLA)).save_pretrained(tmp_path / "folder")
        return {"type": "deepseek_v3", "hf_path": str(tmp_path / "folder")}
    config = Glm4MoeConfig(**SMALL, num_key_value_heads=2, head_dim=8, attention_bias=True).to_dict()
    return {"type": "deepseek_v3", "hf_config": config}


@pytest.mark.parametrize("case", CASES)
def test_peft_folder_and_merged_weights_give_this_runs_logits(case, tmp_path):
    targets, peft_targets = CASES[case]
    # The bias stays as loaded: a LoRA checkpoint holds the adapters only, so a bias the rule moved would not be in
    # it (nor in the exported base): the base, its router bias included, is the one the run started from.
    model = {
        **model_section(case, tmp_path),
        "lora": {**LORA, "target_modules": targets},
        "router_bias_update_speed": 0,
    }
    raw = {"model": model, "data": {"seq_len": 32, "total_steps": 3}, "adam": {"lr": 2e-2}}
    (tmp_path / "run").mkdir()
    trainer = build_trainer(resolve_config({**raw, "monitor": {"progress_bar": "off"}}), CTX, tmp_path / "run")
    try:
        trainer.train()
    finally:
        trainer.close()
    checkpoint = latest_checkpoint(tmp_path / "run" / "checkpoints")
    for flags, out in (["--peft"], "adapter"), (["--hf"], "base"), (["--hf", "--merge"], "merged"):
        assert export([str(checkpoint), str(tmp_path / out), *flags]) == 0

    from transformers import AutoModelForCausalLM

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == peft_targets
    tokens = torch.randint(0, 259, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = trainer.model.eval()(tokens).logits
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
        lora_b = [p for n, p in adapted.named_parameters() if "lora_B" in n]
        assert len(lora_b) == 2 * len(targets)  # each block's
        assert all(p.abs().sum() > 0 for p in lora_b)  # trained, and every one found its module
        torch.testing.assert_close(adapted(input_ids=tokens).logits, ours, rtol=1e-5, atol=1e-5)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        torch.testing.assert_close(merged(input_ids=tokens).logits, ours, rtol=1e-5, atol=1e-5)
        with adapted.disable_adapter():  # the adapters matter: without them the logits differ
            assert not torch.allclose(adapted(input_ids=tokens).logits, ours, rtol=1e-5, atol=1e-5)
