"""`model.type="hf_causal_lm"` routers: the noaux_tc bias trained as XTuner trains it (DeepSeek-V3, GLM-4.5), the aux
loss of documents packed apart (Mixtral, GPT-OSS), packed rows refused for linear attention (Qwen3-Next, Qwen3.5-MoE),
a vision-language folder's text model (Qwen3.5-MoE). Tiny random models saved by transformers, one per family."""

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from chat_fixtures import WORDS, save_chatml_tokenizer

from internlm_offload.builder import build_trainer
from internlm_offload.config import ConfigError, resolve_config
from internlm_offload.device import Accelerator
from internlm_offload.engine.loss import weighted_aux_losses
from internlm_offload.engine.runtime import RunContext
from internlm_offload.model.families.hf_causal_lm.model import HFCausalLM, _document_mask

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
SPEED = 0.001  # model.router_bias_update_speed's default, XTuner's


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


def expected_bias(bias: torch.Tensor, chosen: list[torch.Tensor]) -> torch.Tensor:
    """The rule, written out: -SPEED where an expert was chosen more often than its router's mean, +SPEED where less."""
    counts = sum(torch.bincount(ids.flatten(), minlength=bias.numel()).float() for ids in chosen)
    mean = counts.mean()
    return torch.where(counts > mean, bias - SPEED, torch.where(counts < mean, bias + SPEED, bias))


def train_recounting(trainer) -> tuple[list[list[torch.Tensor]], list[float]]:
    """Train, checking after each step that every router's bias moved by the rule over the choices this test counted
    itself (its own hooks); returns each step's biases and XTuner's maxvio of those counts."""
    routers = trainer.model.routers.bias_routers
    chosen: list[list[torch.Tensor]] = [[] for _ in routers]
    for i, router in enumerate(routers):
        router.register_forward_hook(lambda module, args, out, i=i: chosen[i].append(out[2].detach().clone()))
    step, history, maxvio = trainer.train_step, [], []

    def train_step(micro_batches):
        before = [r.e_score_correction_bias.clone() for r in routers]
        for ids in chosen:
            ids.clear()
        result = step(micro_batches)
        after = [r.e_score_correction_bias.clone() for r in routers]
        for old, new, ids in zip(before, after, chosen):
            assert len(ids) == len(micro_batches) and new.dtype == torch.float32
            assert torch.equal(new, expected_bias(old, ids)), (old, new)
        counts = [sum(torch.bincount(i.flatten(), minlength=4).float() for i in ids) for ids in chosen]
        maxvio.append(sum(float((c.max() - c.mean()) / c.mean()) for c in counts) / len(counts))
        history.append(after)
        return result

    trainer.train_step = train_step
    trainer.train()
    return history, maxvio


@pytest.mark.parametrize("family, dtype", [("deepseek_v3", "torch.float32"), ("glm4_moe", "torch.bfloat16")])
def test_the_router_bias_moves_by_xtuners_rule_and_resumes_bitwise(family, dtype, chat, tiny, tmp_path):
    """3 steps of 2 micro-batches on chat data: each bias moves by the rule over the step's choices, stays fp32 (in
    bf16 one tensor in the model and its fp32 masters, which checkpoints save, exported in fp32); deepseek_v3
    resumes bitwise."""
    resume = family == "deepseek_v3"  # the checkpoint round trip once
    ckpt = {"enable_save_ckpt": True, "checkpoint_every": 2 if resume else 0}
    raw = run_config(tiny(family), chat, ckpt=ckpt, model={"dtype": dtype})
    trainer = trainer_of(raw, tmp_path / "run")
    saved = dict(trainer.state_module.named_buffers())
    assert all(any(b is r.e_score_correction_bias for b in saved.values()) for r in trainer.model.routers.bias_routers)
    history, maxvio = train_recounting(trainer)
    trainer.close()
    assert len(history) == 3 and not torch.equal(history[-1][0], torch.zeros(4))  # it moved
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["moe_maxvio"] for r in records] == pytest.approx(maxvio, rel=1e-6) and "moe_aux_loss" not in records[0]
    if not resume:  # `export --hf --dtype bfloat16` keeps the bias fp32, as transformers loads it
        from transformers import AutoModelForCausalLM

        from internlm_offload.tools import export

        assert (
            export.main([str(tmp_path / "run" / "checkpoints"), str(tmp_path / "hf"), "--hf", "--dtype", "bfloat16"])
            == 0
        )
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").model.layers
        assert all(torch.equal(layer.mlp.gate.e_score_correction_bias, b) for layer, b in zip(exported, history[-1]))
        return
    again = trainer_of(raw, tmp_path / "resumed")
    again.resume_from(tmp_path / "run" / "checkpoints" / "step_00000002")
    assert all(torch.equal(r.e_score_correction_bias, b) for r, b in zip(again.model.routers.bias_routers, history[1]))
    resumed, _ = train_recounting(again)
    again.close()
    assert all(torch.equal(a, b) for a, b in zip(resumed[0], history[2]))
    last = json.loads((tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3 and last["loss"] == records[-1]["loss"] and last["moe_maxvio"] == records[-1]["moe_maxvio"]


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_the_aux_loss_of_documents_packed_apart_is_transformers_loss_over_every_token(family, chat, tiny, tmp_path):
    """Two documents in a row (a 4-D mask): the weighted aux loss equals transformers' own function on the same
    router logits with every token real; chat data kept apart trains and logs it."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = HFCausalLM(path=str(tiny(family)))
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(6), torch.arange(10)])[None].expand(2, -1)
    aux = weighted_aux_losses(model(ids, positions).aux_losses, model.aux_loss_coefficients)
    mask = _document_mask(positions, torch.float32)
    routed = model.hf_model.model(input_ids=ids, position_ids=positions, attention_mask=mask, output_router_logits=True)
    assert torch.equal(aux["moe_aux"], load_balancing_loss_func(routed.router_logits, 4, 2) * 0.02)
    trainer = trainer_of(run_config(tiny(family), chat, data={"total_steps": 3}), tmp_path)
    trainer.train()
    trainer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(0 < r["moe_aux_loss"] < 1 for r in records)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_gated_deltanet_refuses_documents_packed_apart_in_one_line(family, chat, tiny, tmp_path):
    from runner import TINY as BASE
    from runner import train
    from test_bad_input import assert_clean_error

    tokenizer, data = chat
    config = tmp_path / "cfg.py"
    config.write_text(
        f"_base_ = [{str(BASE)!r}]\n"
        f"model = dict(_delete_=True, type='hf_causal_lm', hf_path={str(tiny(family))!r})\n"
        f"data = dict(type='chat', tokenizer={str(tokenizer)!r}, paths=[{str(data)!r}], total_steps=1)\n"
    )
    proc = train(tmp_path / "run", config=config, check=False)
    assert_clean_error(
        proc, "data.pack_sample_into_one=False (data.type='chat')", "linear_attention layers [0]",
        "set data.pack_sample_into_one=True",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="linear_attention"):  # also with dropout or a config dict: the same check
        trainer_of(run_config(tiny(family), chat), tmp_path / "in_process")


def test_a_vision_language_folder_trains_its_text_model_with_its_aux_loss(chat, tiny, tmp_path):
    """Qwen3.5-MoE's composite folder: Qwen3_5MoeForCausalLM from text_config, every text weight loaded, the aux
    loss coefficient read from text_config; a folder whose text weights transformers cannot map is refused."""
    from safetensors.torch import load_file, save_file

    folder = tiny("qwen3_5_moe")
    model = HFCausalLM(path=str(folder))
    saved = load_file(folder / "model.safetensors")
    assert type(model.hf_model).__name__ == "Qwen3_5MoeForCausalLM" and model.aux_loss_coefficients == {"moe_aux": 0.02}
    assert torch.equal(
        model.hf_model.model.layers[1].mlp.gate.weight, saved["model.language_model.layers.1.mlp.gate.weight"]
    )
    raw = run_config(folder, chat, data={"pack_sample_into_one": True, "total_steps": 2})
    trainer = trainer_of(raw, tmp_path / "run")
    trainer.train()
    trainer.close()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["moe_aux_loss"] < 1 for r in records)
    renamed = tmp_path / "renamed"
    shutil.copytree(folder, renamed)
    save_file({k.replace("language_model.", "text."): v for k, v in saved.items()}, renamed / "model.safetensors")
    with pytest.raises(ValueError, match=r"weights of its text model \(Qwen3_5MoeForCausalLM\) are not in the folder"):
        HFCausalLM(path=str(renamed))
