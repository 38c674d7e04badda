"""XTuner v1 configs, written as XTuner's examples are (imports from xtuner.v1, env knobs, a `trainer`),
translate with a report of every dropped field and train 3 steps; what cannot carry stops in one line."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from chat_fixtures import WORDS, save_chatml_tokenizer
from runner import losses, metrics, run_python, train
from test_bad_input import assert_clean_error

pytestmark = pytest.mark.e2e

SFT = """\
import os

from xtuner.v1.config import AdamWConfig, FSDPConfig, LRConfig
from xtuner.v1.datasets import DataloaderConfig, DatasetConfig, OpenaiTokenizeFunctionConfig
from xtuner.v1.loss import CELossConfig
from xtuner.v1.model import get_model_config_from_hf
from xtuner.v1.train import TrainerConfig

MODEL = {model!r}
model_cfg = get_model_config_from_hf(MODEL)
model_cfg.rope_scaling_cfg = None  # XTuner configs mutate their model configs
dataset_config = [
    {{
        "dataset": DatasetConfig(name="sft", anno_path={data!r}, sample_ratio=1.0),
        "tokenize_fn": OpenaiTokenizeFunctionConfig(chat_template="qwen3", max_length=48),
    }}
]
dataloader_config = DataloaderConfig(dataset_config_list=dataset_config, pack_max_length=64, pack_level="soft")
optim_cfg = {optim}
lr_cfg = LRConfig(lr_type="linear", warmup_ratio=1, lr_min=1e-5)
fsdp_cfg = FSDPConfig(recompute_ratio=0.5, cpu_offload=False, ep_size=int(os.environ.get("EP_SIZE", "1")))
trainer = TrainerConfig(
    model_cfg=model_cfg,
    load_from=MODEL,
    optim_cfg=optim_cfg,
    lr_cfg=lr_cfg,
    fsdp_cfg=fsdp_cfg,
    dataloader_cfg=dataloader_config,
    loss_cfg=CELossConfig(mode="chunk", chunk_size=1024),
    global_batch_size=2,
    {length},
    work_dir="work_dirs/sft_tiny",
    hf_interval=100,
    seed=7,
)
"""
ADAMW = 'AdamWConfig(lr=1e-3, foreach=False, swap_optimizer=os.environ.get("SWAP_OPTIMIZER", "0") == "1")'

# XTuner's swap-optimizer recipe for GLM-5.2 (examples/v1/config/sft_glm5p2.py), in its shape and with its
# environment knobs (GLM5_2_MODEL_PATH, ALPACA_PATH, SWAP_OPTIMIZER, EP_SIZE, SP_SIZE, TOTAL_STEP, GLOBAL_BATCH_SIZE,
# SAMPLE_MAX_LENGTH, PACK_MAX_LENGTH, FP8, DISPATCHER): an `X | None` annotation on a stand-in class, model_cfg
# mutations (one shared MTP layer for 7 depths, the dispatcher, float8, the sparse-attention backend), the chunked loss.
GLM_SWAP = """\
import os
from typing import Literal, cast

from xtuner.v1.config import AdamWConfig, FSDPConfig, LRConfig
from xtuner.v1.datasets import OpenaiTokenizeFunctionConfig
from xtuner.v1.datasets.config import DataloaderConfig, DatasetConfig
from xtuner.v1.float8.config import Float8Config, ScalingGranularity
from xtuner.v1.loss import CELossConfig
from xtuner.v1.model import get_model_config_from_hf
from xtuner.v1.module.mtp import MTPConfig
from xtuner.v1.train import TrainerConfig


def env_flag(name: str, default: bool = False) -> bool:
    return os.environ.get(name, "1" if default else "0").lower() in ("1", "true", "yes", "on")


def float8() -> Float8Config | None:  # the annotation the stand-ins must evaluate
    return Float8Config(scaling_granularity_gemm=ScalingGranularity.TILEWISE) if env_flag("FP8") else None


def dispatcher() -> None | str:
    name = os.environ.get("DISPATCHER", "all2all").lower()
    return None if name in ("", "none") else name


MODEL = os.environ["GLM5_2_MODEL_PATH"]
ep_size = int(os.environ.get("EP_SIZE", "1"))
loss_cfg = CELossConfig(mode="chunk", chunk_size=1024)
model_cfg = get_model_config_from_hf(MODEL)
model_cfg.mtp_config = MTPConfig(num_layers=7, share_weights=True, loss_scaling_factor=0.1)
model_cfg.dispatcher = dispatcher()
model_cfg.ep_size = ep_size
model_cfg.float8_cfg = float8()
model_cfg.lm_loss_cfg = loss_cfg
if model_cfg.mtp_config is not None:
    model_cfg.mtp_config.loss_type = cast(Literal["ce", "e2e_tv"], os.environ.get("MTP_LOSS_TYPE", "ce"))
    model_cfg.mtp_config.tv_loss_chunk_size = 128
if hasattr(model_cfg.attention, "sparse_mla_backend"):
    model_cfg.attention.sparse_mla_backend = os.environ.get("SPARSE_MLA_BACKEND", "tilelang")
dataset_config = [
    {
        "dataset": DatasetConfig(name="alpaca", anno_path=os.environ["ALPACA_PATH"], sample_ratio=1.0),
        "tokenize_fn": OpenaiTokenizeFunctionConfig(
            chat_template="glm5.2", max_length=int(os.environ.get("SAMPLE_MAX_LENGTH", "4096"))
        ),
    }
]
trainer = TrainerConfig(
    model_cfg=model_cfg,
    load_from=MODEL,
    tokenizer_path=MODEL,
    optim_cfg=AdamWConfig(lr=1e-3, foreach=False, swap_optimizer=env_flag("SWAP_OPTIMIZER")),
    dataloader_cfg=DataloaderConfig(
        dataset_config_list=dataset_config, pack_max_length=int(os.environ.get("PACK_MAX_LENGTH", "16384"))
    ),
    lr_cfg=LRConfig(lr_type="cosine", warmup_ratio=0.0),
    loss_cfg=loss_cfg,
    fsdp_cfg=FSDPConfig(cpu_offload=env_flag("CPU_OFFLOAD"), ep_size=ep_size),
    global_batch_size=int(os.environ.get("GLOBAL_BATCH_SIZE", "8")),
    total_step=int(os.environ.get("TOTAL_STEP", "10")),
    sp_size=int(os.environ.get("SP_SIZE", "1")),
    work_dir="work_dirs/glm52_sft",
)
"""


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory) -> tuple[Path, Path, Path]:
    """An HF Llama folder holding its tokenizer (ChatML, built here), chat jsonl and pretrain jsonl."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("xtuner")
    model = root / "model"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(model)
    save_chatml_tokenizer(model)
    rng = random.Random(0)
    say = lambda: " ".join(rng.choices(WORDS[4:], k=rng.randint(2, 8)))
    sft, pretrain = root / "sft.jsonl", root / "pretrain.jsonl"
    sft.write_text("".join(json.dumps([{"role": "user", "content": say()}, {"role": "assistant", "content": say()}])
                           + "\n" for _ in range(40)))  # fmt: skip
    pretrain.write_text("".join(json.dumps({"content": say()}) + "\n" for _ in range(60)))
    return model, sft, pretrain


def from_xtuner(config: Path, out: Path | None, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "internlm_offload.tools.from_xtuner", str(config)]
    cmd += ["--out", str(out)] if out is not None else []
    return run_python(cmd, timeout=300, env=env)


def test_an_sft_config_translates_reports_and_trains(model_and_data, tmp_path):
    model, sft, _ = model_and_data
    config = tmp_path / "sft_tiny.py"
    config.write_text(SFT.format(model=str(model), data=str(sft), optim=ADAMW, length="total_step=3"))
    out = tmp_path / "translated.py"
    proc = from_xtuner(config, out, env={"SWAP_OPTIMIZER": "1", "EP_SIZE": "2", "XTUNER_ACTIVATION_OFFLOAD": "1"})
    assert proc.returncode == 0, proc.stderr
    dropped = [line for line in proc.stderr.splitlines() if line.startswith("dropped: ")]
    for field in ("chat_template='qwen3'", "fsdp_cfg.ep_size=2: parallel.expert.size=2 needs", "hf_interval=100"):
        assert any(field in line for line in dropped), field
    assert "carried: loss_cfg.mode='chunk' (chunk_size=1024): the loss here is chunked already" in proc.stderr
    text = out.read_text()
    for carried in ("swap_optimizer = True", "'type': 'chat'", "'checkpoint': 0.5",
                    "'num_layers': 1", "'ckpt_type': 'hf'", "'type': 'linear'", "'global_bsz': 2"):  # fmt: skip
        assert carried in text, carried
    train(tmp_path / "run", "monitor.progress_bar=off", config=out, fast=False)
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3]


def test_a_pretrain_config_counts_its_epochs_into_steps_and_trains(model_and_data, tmp_path):
    model, _, pretrain = model_and_data
    config = tmp_path / "pretrain_tiny.py"
    text = SFT.format(model=str(model), data=str(pretrain), optim=ADAMW, length="total_epoch=1")
    config.write_text(text.replace("OpenaiTokenizeFunctionConfig(chat_template=\"qwen3\", max_length=48)",
                                   "PretrainTokenizeFunctionConfig(add_eos_token=True)").replace(
        "OpenaiTokenizeFunctionConfig", "PretrainTokenizeFunctionConfig"))  # fmt: skip
    out = tmp_path / "translated.py"
    proc = from_xtuner(config, out)
    assert proc.returncode == 0, proc.stderr
    steps = int(proc.stderr.split("total_epoch=1 -> data.total_steps=")[1].split()[0])
    assert steps >= 3 and "'type': 'text'" in out.read_text()
    train(tmp_path / "run", "monitor.progress_bar=off", config=out, fast=False)
    assert sorted(losses(tmp_path / "run")) == list(range(1, steps + 1))


def test_what_cannot_carry_stops_in_one_line_and_writes_nothing(model_and_data, tmp_path):
    model, sft, _ = model_and_data
    config = tmp_path / "lion.py"
    config.write_text(SFT.format(model=str(model), data=str(sft), optim="LionConfig(lr=1e-3)", length="total_step=3")
                      .replace("from xtuner.v1.config import", "from xtuner.v1.config import LionConfig,"))  # fmt: skip
    out = tmp_path / "translated.py"
    assert_clean_error(
        from_xtuner(config, out), "cannot be carried over", "optim_cfg=LionConfig(...): only AdamWConfig and MuonConfig"
    )
    assert not out.exists()
    proc = train(tmp_path / "run", config=config, check=False)
    assert_clean_error(proc, "is an XTuner config", "python -m internlm_offload.tools.from_xtuner")


def test_a_muon_config_translates_and_trains_under_its_fsdp(model_and_data, tmp_path):
    """XTuner's MuonConfig: `optimizer.type='muon'` under XTuner's FSDP (each matrix gathered whole), 3 steps."""
    model, sft, _ = model_and_data
    config = tmp_path / "muon.py"
    config.write_text(SFT.format(model=str(model), data=str(sft), optim="MuonConfig(lr=1e-3)", length="total_step=3")
                      .replace("from xtuner.v1.config import", "from xtuner.v1.config import MuonConfig,"))  # fmt: skip
    out = tmp_path / "translated.py"
    proc = from_xtuner(config, out)
    assert proc.returncode == 0, proc.stderr
    assert "five distinct coefficient triples" in proc.stderr
    text = out.read_text()
    assert "'type': 'muon'" in text and "'adjust_lr_fn': 'match_rms_adamw'" in text and "'mode': 'fsdp2'" in text
    train(tmp_path / "run", "monitor.progress_bar=off", config=out, fast=False)
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3]


def test_xtuners_glm5_swap_recipe_translates_and_trains_with_the_swap_optimizer(model_and_data, tmp_path):
    """The GLM-5.2 recipe's shape with SWAP_OPTIMIZER=1 on a tiny GLM-5 folder made by transformers (`glm_moe_dsa`:
    DeepSeek sparse attention with top-k 16 below the 64-token packs, one MTP layer) holding the test's chat
    tokenizer: it translates (exit 0) onto the native family with the swap optimizer, one shared MTP layer for 7
    depths, the chunked loss carried, FP8 / the dispatcher / the sparse-attention backend named as GPU-only kernels;
    the output trains 2 steps from the folder, alpaca
    conversations through the folder's chat template, `mtp_loss` logged."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    _, sft, _ = model_and_data
    folder = tmp_path / "glm5"
    torch.manual_seed(0)
    config = GlmMoeDsaConfig(vocab_size=32, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
                             num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                             num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                             n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                             qk_rope_head_dim=8, v_head_dim=8, index_topk=16, index_n_heads=4, index_head_dim=16,
                             num_nextn_predict_layers=1, max_position_embeddings=128)  # fmt: skip
    GlmMoeDsaForCausalLM(config).save_pretrained(folder)
    save_chatml_tokenizer(folder)
    recipe = tmp_path / "sft_glm5p2.py"
    recipe.write_text(GLM_SWAP)
    out = tmp_path / "translated.py"
    env = {"GLM5_2_MODEL_PATH": str(folder), "ALPACA_PATH": str(sft), "SWAP_OPTIMIZER": "1", "TOTAL_STEP": "2",
           "GLOBAL_BATCH_SIZE": "2", "SAMPLE_MAX_LENGTH": "48", "PACK_MAX_LENGTH": "64", "FP8": "1"}  # fmt: skip
    proc = from_xtuner(recipe, out, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model.type='deepseek_v3', model.hf_path (model_type='glm_moe_dsa'" in proc.stderr
    assert "optim_cfg.swap_optimizer -> swap_optimizer" in proc.stderr
    assert "carried: loss_cfg.mode='chunk' (chunk_size=1024): the loss here is chunked already" in proc.stderr
    dropped = [line for line in proc.stderr.splitlines() if line.startswith("dropped: ")]
    for field in ("model_cfg.float8_cfg=", "model_cfg.dispatcher='all2all'", "model_cfg.attention.sparse_mla_backend"):
        assert any(line.startswith(f"dropped: {field}") and "GPU-only" in line for line in dropped), field
    text = out.read_text()
    assert "swap_optimizer = True" in text and "'num_layers': 7" in text and "'share_weights': True" in text
    train(tmp_path / "run", "monitor.progress_bar=off", config=out, fast=False)
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2] and all(r["mtp_loss"] > 0 for r in records)


# XTuner's examples/v1/pretrain_qwen3_tiny.py as it ships (InternLM/xtuner main), shrunk where it must be to run
# here: the model class gets keyword overrides (2 blocks, width 64, the test tokenizer's vocabulary; XTuner's
# classes take them), tokenizer_path and anno_path are local (the shipped ones are a hub id and a file of XTuner's
# checkout), pack_max_length 4096 -> 64, global_batch_size 8 -> 2, and total_epoch=1 -> total_step=3. Everything
# else (two datasets with sample ratios, chunked CE loss, lr config) is as shipped.
PRETRAIN_QWEN3_TINY = """\
from xtuner.v1.config import (
    AdamWConfig,
    LRConfig,
)
from xtuner.v1.train import TrainerConfig
from xtuner.v1.datasets.pt_tokenize_fn import PretrainTokenizeFunctionConfig
from xtuner.v1.model import Qwen3Dense4BConfig
from xtuner.v1.module.attention import MHAConfig
from xtuner.v1.loss import CELossConfig
from xtuner.v1.datasets.config import DatasetConfig, DataloaderConfig

# model config
model_cfg = Qwen3Dense4BConfig(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=160,
    vocab_size=32,
    attention=MHAConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=32, qk_norm=True, sliding_window=1024),
)

# dataset and dataloader config
sample_max_length = 64
pack_max_length = 64

dataset_config = [
    {{
        "dataset": DatasetConfig(
            name="source1",
            anno_path={data!r},
            sample_ratio=10000.0,
        ),
        "tokenize_fn": PretrainTokenizeFunctionConfig(
            add_special_tokens=True,
            add_eos_token=True,
        ),
    }},
    {{
        "dataset": DatasetConfig(
            name="source2",
            anno_path={data!r},
            sample_ratio=20000.0,
        ),
        "tokenize_fn": PretrainTokenizeFunctionConfig(
            add_special_tokens=False,
            add_eos_token=True,
        ),
    }},
]
dataloader_config = DataloaderConfig(
    pack_max_length=pack_max_length
)

# optimizer and lr config
optim_cfg = AdamWConfig(lr=1e-4, foreach=False)
lr_cfg = LRConfig(lr_type="constant", warmup_ratio=0)

# trainer config
trainer = TrainerConfig(
    model_cfg=model_cfg,
    optim_cfg=optim_cfg,
    dataset_cfg=dataset_config,
    dataloader_cfg=dataloader_config,
    tokenizer_path={tokenizer!r},
    lr_cfg=lr_cfg,
    loss_cfg=CELossConfig(mode="chunk", chunk_size=1024),
    global_batch_size=2,
    total_step=3,
    work_dir="work_dir/pretrain_qwen3_tiny",
    # load_from="Qwen/Qwen3-4B",
)
"""


def test_xtuners_pretrain_qwen3_tiny_example_builds_its_model_class_and_trains(model_and_data, tmp_path):
    """`model_cfg = Qwen3Dense4BConfig(...)` without load_from: the native Qwen3 (q/k norms, head_dim apart from
    hidden / heads, tied embeddings as the 4B class has them), initialised at random as XTuner does."""
    model, _, pretrain = model_and_data
    config = tmp_path / "pretrain_qwen3_tiny.py"
    config.write_text(PRETRAIN_QWEN3_TINY.format(data=str(pretrain), tokenizer=str(model)))
    out = tmp_path / "translated.py"
    proc = from_xtuner(config, out)
    assert proc.returncode == 0, proc.stderr
    assert "model_cfg=Qwen3Dense4BConfig(...) -> the native model" in proc.stderr
    text = out.read_text()
    for carried in ("'head_dim': 32", "'qk_norm': True", "'tie_word_embeddings': True", "'rope_base': 5000000.0",
                    "'num_kv_attention_heads': 2", "'type': 'text'", "'total_steps': 3"):  # fmt: skip
        assert carried in text, carried
    assert "load_ckpt_info" not in text
    train(tmp_path / "run", "monitor.progress_bar=off", config=out, fast=False)
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3]


def test_a_classic_xtuner_lora_config_translates_and_trains_with_lora(model_and_data, tmp_path):
    """XTuner's classic internlm2 QLoRA config shape (mmengine dicts, oasst1 jsonl, a local Llama folder): the
    4-bit base (BitsAndBytesConfig) and LoRA carry, and 3 steps train with the base frozen in 4 bits: the Llama
    folder's weights loaded into the native decoder, quantized as they arrive."""
    from classic_fixtures import oasst1_lines, write_classic
    from torch.distributed.checkpoint import FileSystemReader

    model, _, _ = model_and_data
    data = tmp_path / "oasst1.jsonl"
    data.write_text(oasst1_lines(40))
    config = write_classic(tmp_path / "internlm2_chat_7b_qlora_oasst1_e3.py", model, data)  # fp16, as XTuner's
    out = tmp_path / "translated.py"
    proc = from_xtuner(config, out)
    assert proc.returncode == 0, proc.stderr
    assert "carried: model.llm.quantization_config (load_in_4bit, bnb_4bit_quant_type" in proc.stderr
    assert "carried: optim_wrapper.accumulative_counts=2 -> data.micro_num" in proc.stderr
    text = out.read_text()
    for carried in ("'lora': {'r': 64", "'chat_format': 'oasst1'", "'micro_num': 2", "'type': 'cosine'",
                    "'quantization_config': {'load_in_4bit': True", "'bnb_4bit_quant_type': 'nf4'"):  # fmt: skip
        assert carried in text, carried
    run = tmp_path / "run"
    proc = train(run, "monitor.progress_bar=off", "data.total_steps=3", config=out, fast=False)
    assert sorted(losses(run)) == [1, 2, 3]
    log = proc.stdout + proc.stderr
    assert "QLoRA: 14 frozen block linears held in 4 bits (nf4, double quantization, computed in torch.float16)" in log
    assert "Loaded hf model weights" in log
    # LoRA was on: the checkpoint holds the 7 projections' adapters of both blocks and no base weight
    reader = FileSystemReader(str(run / "checkpoints" / "step_00000003"))
    held = [key for key in reader.read_metadata().state_dict_metadata if key.startswith("model.")]
    assert len(held) == 2 * 7 * 2 and all(".lora_A." in key or ".lora_B." in key for key in held), held
