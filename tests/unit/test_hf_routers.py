"""`model.type="hf_causal_lm"` routers: the aux loss of documents packed apart (Mixtral, GPT-OSS). Tiny random models
saved by transformers, one per family."""

import json
import random
from pathlib import Path

import pytest
import torch
from chat_fixtures import WORDS, save_chatml_tokenizer

from internlm_offload.builder import build_trainer
from internlm_offload.config import resolve_config
from internlm_offload.device import Accelerator
from internlm_offload.engine.runtime import RunContext
from internlm_offload.model.hf import HFCausalLM, _document_mask

MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 16, "intermediate_size": 64}
NOAUX = {**MOE, "n_routed_experts": 4, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0}
MLA = {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 32}
GATED_DELTANET = {**TINY, **MOE, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4,
                  "shared_expert_intermediate_size": 16, "linear_num_value_heads": 2, "linear_num_key_heads": 2,
                  "linear_key_head_dim": 8, "linear_value_head_dim": 8, "router_aux_loss_coef": 0.02,
                  "layer_types": ["linear_attention", "full_attention"]}  # fmt: skip
FAMILIES = {
    "deepseek_v3": {**TINY, **NOAUX, **MLA, "num_key_value_heads": 4},
    "glm4_moe": {**TINY, **NOAUX, "num_key_value_heads": 2},
    "mixtral": {**TINY, **MOE, "num_local_experts": 4, "num_key_value_heads": 2, "router_aux_loss_coef": 0.02},
    "qwen3_next": GATED_DELTANET,
    "gpt_oss": {**TINY, **MOE, "num_local_experts": 4, "num_key_value_heads": 2, "head_dim": 8,
                "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8, "router_aux_loss_coef": 0.02},
}  # fmt: skip
VISION = {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32, "out_hidden_size": 32}


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A ChatML tokenizer and 40 random conversations."""
    root = tmp_path_factory.mktemp("chat")
    rng = random.Random(0)
    say = lambda: " ".join(rng.choice(WORDS[4:]) for _ in range(rng.randint(2, 8)))  # noqa: E731
    lines = [[{"role": "user", "content": say()}, {"role": "assistant", "content": say()}] for _ in range(40)]
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in lines))
    return save_chatml_tokenizer(root / "tokenizer"), data


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """`tiny(family)`: the folder of a random tiny model of `family`, saved by transformers' save_pretrained once per
    module; "qwen3_5_moe" is the vision-language model (Qwen3_5MoeForConditionalGeneration)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

    root, folders = tmp_path_factory.mktemp("tiny"), {}

    def folder(family: str) -> Path:
        if family not in folders:
            torch.manual_seed(0)
            if family == "qwen3_5_moe":
                config = AutoConfig.for_model(family, text_config=GATED_DELTANET, vision_config=VISION)
                model = Qwen3_5MoeForConditionalGeneration(config)
            else:
                model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **FAMILIES[family]))
            model.save_pretrained(root / family)
            folders[family] = root / family
        return folders[family]

    return folder


def run_config(folder: Path, chat: tuple[Path, Path], **sections: dict) -> dict:
    tokenizer, data = chat
    raw = {
        "model": {"type": "hf_causal_lm", "hf_path": str(folder)},
        "data": {"type": "chat", "tokenizer": str(tokenizer), "paths": [str(data)], "seq_len": 32, "micro_bsz": 1,
                 "micro_num": 2, "total_steps": 3},
        "ckpt": {"enable_save_ckpt": False},
        "monitor": {"progress_bar": "off"},
    }  # fmt: skip
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def trainer_of(raw: dict, work_dir: Path):
    ctx = RunContext(rank=0, local_rank=0, world_size=1, accelerator=Accelerator("cpu"))
    work_dir.mkdir(parents=True, exist_ok=True)
    return build_trainer(resolve_config(raw), ctx, work_dir)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_the_aux_loss_of_documents_packed_apart_is_transformers_loss_over_every_token(family, chat, tiny, tmp_path):
    """Two documents in a row (a 4-D mask): the weighted aux loss equals transformers' own function on the same
    router logits with every token real; chat data kept apart trains and logs it."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = HFCausalLM(path=str(tiny(family)))
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(6), torch.arange(10)])[None].expand(2, -1)
    _, aux = model(ids, positions)
    mask = _document_mask(positions, torch.float32)
    routed = model.hf_model.model(input_ids=ids, position_ids=positions, attention_mask=mask, output_router_logits=True)
    assert torch.equal(aux, load_balancing_loss_func(routed.router_logits, 4, 2) * 0.02)
    trainer = trainer_of(run_config(tiny(family), chat, data={"total_steps": 2}), tmp_path)
    trainer.train()
    trainer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(0 < r["moe_aux_loss"] < 1 for r in records)
