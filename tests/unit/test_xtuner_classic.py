"""XTuner's classic (mmengine) LoRA configs without xtuner, mmengine or datasets: the file runs with stand-ins,
each key is mapped or reported, and XTuner's alpaca / oasst1 lines are read as its map functions read them."""

import json
import sys
from pathlib import Path

import pytest
import torch
from chat_fixtures import save_chatml_tokenizer
from classic_fixtures import oasst1_lines, write_classic

from internlm_offload.config import resolve_config
from internlm_offload.data.chat import BadLine, parse_conversation
from internlm_offload.data.chat_formats import ALPACA_SYSTEM
from internlm_offload.xtuner.classic import translate_classic
from internlm_offload.xtuner.standins import is_classic, load_classic


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny Llama folder (config.json only: the mapping reads no weights) holding a ChatML tokenizer."""
    folder = tmp_path_factory.mktemp("classic") / "llama"
    save_chatml_tokenizer(folder)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 64,
              "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture()
def translated(llama, tmp_path):
    data = tmp_path / "oasst1.jsonl"
    data.write_text(oasst1_lines(40))
    path = write_classic(tmp_path / "internlm2_chat_7b_qlora_oasst1_e3.py", llama, data)
    assert is_classic(path)
    return translate_classic(load_classic(path), path), data


def test_the_file_runs_without_xtuner_mmengine_peft_or_datasets_and_leaves_no_stand_in_behind(llama, tmp_path):
    path = write_classic(tmp_path / "cfg.py", llama, tmp_path / "d.jsonl")
    before = dict(sys.modules)
    names = load_classic(path)
    assert names["optim_wrapper"]["accumulative_counts"] == 2 and names["model"]["lora"]["r"] == 64
    assert repr(names["model"]["llm"]["quantization_config"]["type"]) == "BitsAndBytesConfig"  # a stand-in
    for root in ("xtuner", "mmengine", "peft", "datasets", "bitsandbytes", "transformers"):
        # what was imported before (a real package) is back; no stand-in module stays
        assert {m: v for m, v in sys.modules.items() if m == root or m.startswith(root + ".")} == {
            m: v for m, v in before.items() if m == root or m.startswith(root + ".")
        }, root


def test_each_key_maps_where_it_belongs(translated, llama):
    t, data = translated
    assert not t.fatal, t.fatal
    cfg = t.config
    assert cfg["model"]["lora"] == {"r": 64, "lora_alpha": 16, "lora_dropout": 0.1, "bias": "none",
                                    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"]}  # fmt: skip
    assert cfg["model"]["type"] == "internlm2" and cfg["model"]["num_layers"] == 2
    assert cfg["model"]["dtype"] == "torch.float16" and cfg["model"]["checkpoint"] == 1.0
    assert cfg["model"]["quantization_config"] == {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                                   "bnb_4bit_compute_dtype": "torch.float16",
                                                   "bnb_4bit_use_double_quant": True}  # fmt: skip
    assert cfg["ckpt"]["load_ckpt_info"]["path"] == str(llama)
    assert cfg["adam"] == {"lr": 2e-4, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8, "weight_decay": 0.0}
    assert cfg["hybrid_zero_optimizer"] == {"clip_grad_norm": 1.0}
    assert cfg["data"]["micro_num"] == 2 and cfg["data"]["micro_bsz"] == 1  # accumulative_counts, batch_size
    assert cfg["data"]["seq_len"] == 64 and cfg["data"]["max_length"] == 64
    assert cfg["data"]["type"] == "chat" and cfg["data"]["chat_format"] == "oasst1"
    assert cfg["data"]["paths"] == [str(data)] and cfg["data"]["tokenizer"] == str(llama)
    assert cfg["lr_scheduler"] == {"type": "cosine", "warmup_ratio": pytest.approx(0.03), "eta_min": 0.0}
    assert cfg["ckpt"]["checkpoint_every"] == 500 and cfg["ckpt"]["keep_last"] == 2
    # 40 one-exchange conversations, 6 + words tokens each under ChatML (<|im_start|> role ... <|im_end|> twice):
    # 6 * 40 + 148 words = 388 tokens, 6 whole packs of 64 an epoch; 3 epochs at 2 packs a step
    assert cfg["data"]["total_steps"] == 9
    resolve_config(cfg)  # validates as train.py validates it


def test_the_report_names_what_was_dropped_and_why(translated):
    t, _ = translated
    dropped = "\n".join(t.dropped)
    for expected in ("model.llm.quantization_config (llm_int8_threshold, llm_int8_has_fp16_weight): 8-bit settings",
                     "model.use_varlen_attn=False", "template_map_fn (template=PROMPT_TEMPLATE.internlm2_chat)",
                     "LinearLR.start_factor=1e-05", "custom_hooks=['DatasetInfoHook', 'EvaluateChatHook']"):  # fmt: skip
        assert expected in dropped, expected
    carried = "\n".join(t.carried)
    for expected in ("model.llm.quantization_config (load_in_4bit, bnb_4bit_quant_type, bnb_4bit_compute_dtype, "
                     "bnb_4bit_use_double_quant) -> model.quantization_config",
                     "optim_wrapper.accumulative_counts=2 -> data.micro_num",
                     "model.lora (r, lora_alpha, lora_dropout, bias) -> model.lora",
                     "target_modules unset -> XTuner's every linear but lm_head",
                     "train_cfg.max_epochs=3 -> data.total_steps=9"):  # fmt: skip
        assert expected in carried, expected
    # a line for each key, once: nothing of env_cfg / log_processor (runtime only) or trust_remote_code is reported
    assert not any("trust_remote_code" in line or "env_cfg" in line for line in t.dropped)


def test_alpaca_and_oasst1_lines_read_as_xtuners_map_functions_read_them():
    alpaca = parse_conversation(json.dumps({"instruction": "add", "input": "1 2", "output": "3"}), "alpaca")
    assert [(m["role"], m["content"], m["loss"]) for m in alpaca.messages] == [
        ("system", ALPACA_SYSTEM, False), ("user", "add\n1 2", False), ("assistant", "3", True)]  # fmt: skip
    no_input = parse_conversation(json.dumps({"instruction": "hi", "input": "", "output": "ok"}), "alpaca")
    assert no_input.messages[1]["content"] == "hi\n"  # XTuner's f"{instruction}\n{input}", newline kept
    text = "### Human: a b### Assistant: c### Human: d ### Assistant:e f### Human: unanswered"
    oasst = parse_conversation(json.dumps({"text": text}), "oasst1")
    assert [(m["role"], m["content"]) for m in oasst.messages] == [
        ("user", "a b"), ("assistant", "c"), ("user", "d"), ("assistant", "e f")]  # fmt: skip
    for line, fmt, why in ((json.dumps({"instruction": "x", "output": "<nooutput>"}), "alpaca", "<nooutput>"),
                           (json.dumps({"txt": "x"}), "oasst1", 'no string "text"'),
                           (json.dumps([{"role": "user", "content": "x"}]), "alpaca", "a alpaca line is a JSON object")):  # fmt: skip
        with pytest.raises(BadLine, match=why):
            parse_conversation(line, fmt)


def test_internlm2_folder_without_target_modules_reports_the_head_and_the_fused_wqkv(llama, tmp_path):
    """XTuner's find_all_linear_names on InternLM2's remote code keeps the head `output`: named in the report."""
    folder = tmp_path / "internlm2"
    folder.mkdir()
    config = json.loads((llama / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "internlm2",
                                                    "architectures": ["InternLM2ForCausalLM"]}))  # fmt: skip
    path = write_classic(tmp_path / "cfg.py", folder, tmp_path / "d.jsonl", dtype="bfloat16", quant="")
    t = translate_classic(load_classic(path), path)
    assert t.config["model"]["lora"]["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"]  # fmt: skip
    line = next(line for line in t.dropped if line.startswith("model.lora.target_modules unset"))
    assert "wqkv, wo, w1, w2, w3 and the head `output`" in line and "the head none" in line
    assert not any("quantization_config" in line for line in t.dropped)


def test_hf_causal_lm_takes_xtuners_every_linear_and_the_dtypes_follow_the_wrapper(tmp_path):
    folder = tmp_path / "qwen2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 32, "hidden_size": 64,
                                                    "intermediate_size": 96, "num_hidden_layers": 1,
                                                    "num_attention_heads": 4, "num_key_value_heads": 2}))  # fmt: skip
    path = write_classic(tmp_path / "cfg.py", folder, tmp_path / "d.jsonl", dtype="float16", amp="bfloat16", quant="")
    t = translate_classic(load_classic(path), path)
    assert t.config["model"]["type"] == "hf_causal_lm" and t.config["model"]["dtype"] == "torch.bfloat16"
    assert t.config["model"]["lora"]["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                                           "up_proj", "v_proj"]  # lm_head left out  # fmt: skip
    plain = tmp_path / "plain.py"
    plain.write_text(path.read_text().replace("type=AmpOptimWrapper", "type=OptimWrapper").replace(
        "from mmengine.optim import", "from mmengine.optim import OptimWrapper,"))  # fmt: skip
    assert translate_classic(load_classic(plain), plain).config["model"]["dtype"] == "torch.float16"  # torch_dtype
    (folder / "config.json").write_text(json.dumps({"model_type": "no_such_arch", "vocab_size": 32}))
    t = translate_classic(load_classic(path), path)
    assert any(
        "folder's linears cannot be listed" in line and "name them in target_modules" in line for line in t.fatal
    )


@pytest.mark.parametrize(
    ("old", "new", "fatal"),
    [
        ("type=optim_type, lr", "type=SGD, lr", "optim_wrapper.optimizer.type=SGD: only AdamW"),
        (
            "path='json', data_files=dict(train=data_files)",
            "path='timdettmers/openassistant-guanaco'",
            "a hub dataset is not downloaded",
        ),
        ("type=CosineAnnealingLR,", "type=MultiStepLR,", "param_scheduler=['LinearLR', 'MultiStepLR']"),
        ("task_type='CAUSAL_LM'", "task_type='CAUSAL_LM', use_dora=True", "model.lora.use_dora=True"),
        ("dataset_map_fn=oasst1_map_fn", "dataset_map_fn=None", "dataset_map_fn=None: one of alpaca_map_fn"),
        (
            "load_in_4bit=True,\n            load_in_8bit=False",
            "load_in_4bit=False,\n            load_in_8bit=True",
            "model.llm.quantization_config.load_in_8bit=True: the 8-bit base is not built here",
        ),
    ],
)
def test_what_cannot_carry_is_fatal_and_named(llama, tmp_path, old, new, fatal):
    path = write_classic(tmp_path / "cfg.py", llama, tmp_path / "d.jsonl")
    text = (
        path.read_text()
        .replace(old, new)
        .replace("from torch.optim import AdamW", "from torch.optim import SGD, AdamW")
    )
    path.write_text(text.replace("from mmengine.optim import", "from mmengine.optim import MultiStepLR,"))
    t = translate_classic(load_classic(path), path)
    assert any(fatal in line for line in t.fatal), t.fatal


def test_chat_format_outside_chat_data_is_a_one_line_config_error():
    from internlm_offload.config import ConfigError

    with pytest.raises(ConfigError, match="data.chat_format='alpaca' is read by data.type='chat', not 'text'"):
        resolve_config({"data": {"type": "text", "paths": ["x.jsonl"], "chat_format": "alpaca"}})
    with pytest.raises(ConfigError, match="data.chat_format"):  # not a format XTuner's map functions have
        resolve_config({"data": {"type": "chat", "paths": ["x.jsonl"], "chat_format": "sharegpt"}})


def test_tokenize_reads_oasst1_lines_as_the_same_conversations_written_as_messages(tmp_path):
    """`tools.tokenize --chat --chat-format oasst1` writes what the hand-converted messages file gives, bit for bit."""
    from internlm_offload.data import build_internevo_dataset
    from internlm_offload.tools.tokenize import main as tokenize_main

    tokenizer = save_chatml_tokenizer(tmp_path / "tok")
    oasst1 = tmp_path / "oasst1" / "d.jsonl"
    oasst1.parent.mkdir()
    oasst1.write_text(oasst1_lines(12))
    messages = tmp_path / "messages" / "d.jsonl"
    messages.parent.mkdir()
    say = ["hello there", "how are you", "fine thanks", "hi", "be brief", "ok"]
    messages.write_text("".join(json.dumps([{"role": "user", "content": say[i % 6]},
                                            {"role": "assistant", "content": say[(i + 1) % 6]}]) + "\n"
                                for i in range(12)))  # fmt: skip
    packs = []
    for folder, fmt in ((oasst1.parent, "oasst1"), (messages.parent, "messages")):
        args = [str(folder), str(folder / "bin"), "--tokenizer", str(tokenizer), "--chat", "--chat-format", fmt]
        assert tokenize_main(args) == 0
        dataset = build_internevo_dataset(seq_len=16, micro_bsz=1, train_folder=str(folder / "bin"),
                                          pack_sample_into_one=False, min_length=0)  # fmt: skip
        packs.append([dataset[i] for i in range(len(dataset))])
    assert len(packs[0]) == len(packs[1]) > 3
    for a, b in zip(*packs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_router_bias_folder_keeps_its_bias_as_xtuners_classic_trainer_does(tmp_path):
    """XTuner's classic trainer trains transformers' DeepSeek-V3, which never moves the router bias: here too."""
    folder = tmp_path / "deepseek_v3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "vocab_size": 32, "hidden_size": 32,
                                                    "intermediate_size": 64, "moe_intermediate_size": 16,
                                                    "num_hidden_layers": 2, "num_attention_heads": 4,
                                                    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
                                                    "topk_group": 1, "first_k_dense_replace": 0}))  # fmt: skip
    path = write_classic(tmp_path / "cfg.py", folder, tmp_path / "d.jsonl", quant="")
    t = translate_classic(load_classic(path), path)
    assert (
        not any("is not built here" in line for line in t.fatal)
        and t.config["model"]["router_bias_update_speed"] == 0.0
    )
    assert any("-> model.router_bias_update_speed=0" in line for line in t.carried)
