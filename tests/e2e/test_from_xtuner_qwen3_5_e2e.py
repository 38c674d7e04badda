"""XTuner v1's Qwen3.5 recipe (examples/v1/config/sft_qwen3p5.py) in its shape translates onto the native
`qwen3_next` family (xtuner/qwen3_5.py) and trains, without MTP and as shipped (4 MTP depths through one shared
layer)."""

import json
import random
from pathlib import Path

import pytest
import torch
from chat_fixtures import WORDS, save_chatml_tokenizer
from runner import metrics, train
from test_from_xtuner_e2e import from_xtuner

pytestmark = pytest.mark.e2e

# sft_qwen3p5.py's shape and environment knobs (QWEN3_5_MOE_PATH, ALPACA_PATH, EP_SIZE, MODEL_COMPILE, FP8,
# NORMAL_MTP_LAYERS, SAMPLE_MAX_LENGTH, PACK_MAX_LENGTH, GLOBAL_BATCH_SIZE, TOTAL_STEP, LR, SP_SIZE, ...): the
# vision-language class with only_llm_forward and its text_config mutated (ep_size, dispatcher, float8, MTP), a cosine
# schedule, the chunked loss; the text data path (OpenaiTokenizeFunctionConfig, JsonlDataset). The recipe's MuonConfig
# is AdamW here: Muon reads the family's tensor plan, which the family's layouts work adds.
QWEN3P5 = """\
import os

from xtuner.v1.config import AdamWConfig, FSDPConfig, LRConfig
from xtuner.v1.datasets import OpenaiTokenizeFunctionConfig
from xtuner.v1.datasets.config import DataloaderConfig, DatasetConfig
from xtuner.v1.float8.config import Float8Config, ScalingGranularity
from xtuner.v1.loss import CELossConfig
from xtuner.v1.model import Qwen3_5_VLMoE35BA3Config
from xtuner.v1.model.moe.moe import MTPConfig
from xtuner.v1.train import TrainerConfig


def _get_bool_env(name: str, default: bool = False) -> bool:
    return os.environ.get(name, "1" if default else "0").lower() in ("1", "true", "yes", "on")


WORK_DIR = os.environ.get("WORK_DIR", "work_dirs/qwen3p5_sft")
QWEN3_5_MOE_PATH = os.environ["QWEN3_5_MOE_PATH"]
DATA_PATH = os.environ.get("DATA_PATH", os.environ.get("ALPACA_PATH"))
sample_max_length = int(os.environ.get("SAMPLE_MAX_LENGTH", str(128 * 1024)))
pack_max_length = int(os.environ.get("PACK_MAX_LENGTH", str(128 * 1024)))
ep_size = int(os.environ.get("EP_SIZE", "1"))
model_compile = _get_bool_env("MODEL_COMPILE", True)
total_step = int(os.environ["TOTAL_STEP"]) if "TOTAL_STEP" in os.environ else None

model_cfg = Qwen3_5_VLMoE35BA3Config(only_llm_forward=True, compile_cfg=model_compile)
model_cfg.text_config.ep_size = ep_size
if ep_size > 1:
    model_cfg.text_config.dispatcher = os.environ.get("DISPATCHER", "deepep")
if _get_bool_env("FP8"):
    model_cfg.text_config.float8_cfg = Float8Config(scaling_granularity_gemm=ScalingGranularity.TILEWISE)
normal_mtp_layers = int(os.environ.get("NORMAL_MTP_LAYERS", "4"))
model_cfg.text_config.mtp_config = MTPConfig(
    num_layers=normal_mtp_layers,
    share_weights=normal_mtp_layers > 1,
    loss_scaling_factor=float(os.environ.get("NORMAL_MTP_FACTOR", "1.0")),
)
tokenize_fn = OpenaiTokenizeFunctionConfig(chat_template="qwen3.5-vl", max_length=sample_max_length)
dataset_config = [
    {
        "dataset": DatasetConfig(name="alpaca", anno_path=DATA_PATH, class_name="JsonlDataset", sample_ratio=1.0),
        "tokenize_fn": tokenize_fn,
    }
]
dataloader_config = DataloaderConfig(
    dataset_config_list=dataset_config, pack_level="soft", pack_max_length=pack_max_length, pack_to_max_length=True
)
optim_cfg = AdamWConfig(lr=float(os.environ.get("LR", "2e-5")), weight_decay=0.05, foreach=False)
lr_cfg = LRConfig(lr_type="cosine", warmup_ratio=0.1, lr_min=1e-6)
fsdp_cfg = FSDPConfig(recompute_ratio=float(os.environ.get("RECOMPUTE_RATIO", "1.0")), ep_size=ep_size)
loss_cfg = CELossConfig(mode="chunk", chunk_size=1024)
trainer = TrainerConfig(
    model_cfg=model_cfg,
    load_from=QWEN3_5_MOE_PATH,
    tokenizer_path=QWEN3_5_MOE_PATH,
    fsdp_cfg=fsdp_cfg,
    optim_cfg=optim_cfg,
    dataloader_cfg=dataloader_config,
    lr_cfg=lr_cfg,
    loss_cfg=loss_cfg,
    global_batch_size=int(os.environ.get("GLOBAL_BATCH_SIZE", "16")),
    total_step=total_step,
    total_epoch=None if total_step is not None else 1,
    sp_size=int(os.environ.get("SP_SIZE", "4")),
    hf_interval=500,
    work_dir=WORK_DIR,
)
"""


@pytest.fixture(scope="module")
def folder_and_data(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen3.5-MoE text folder made by transformers (4 blocks: 3 Gated DeltaNet, 1 gated attention; 4 experts
    top-2 and the gated shared expert) holding the test's ChatML tokenizer, and chat jsonl."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    root = tmp_path_factory.mktemp("xtuner_qwen3_5")
    folder = root / "qwen3_5_moe"
    torch.manual_seed(0)
    config = Qwen3_5MoeTextConfig(vocab_size=32, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                  linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                  max_position_embeddings=128)  # fmt: skip
    Qwen3_5MoeForCausalLM(config).save_pretrained(folder)
    save_chatml_tokenizer(folder)
    rng = random.Random(0)
    say = lambda: " ".join(rng.choices(WORDS[4:], k=rng.randint(2, 8)))
    sft = root / "sft.jsonl"
    sft.write_text("".join(json.dumps([{"role": "user", "content": say()}, {"role": "assistant", "content": say()}])
                           + "\n" for _ in range(40)))  # fmt: skip
    return folder, sft


def recipe_env(folder: Path, sft: Path, **more: str) -> dict[str, str]:
    return {"QWEN3_5_MOE_PATH": str(folder), "ALPACA_PATH": str(sft), "TOTAL_STEP": "2", "GLOBAL_BATCH_SIZE": "2",
            "SAMPLE_MAX_LENGTH": "48", "PACK_MAX_LENGTH": "64", "SP_SIZE": "1", "FP8": "1", **more}  # fmt: skip


def test_xtuners_qwen3_5_recipe_translates_and_trains(folder_and_data, tmp_path):
    """NORMAL_MTP_LAYERS=0: the recipe translates (exit 0) onto model.type='qwen3_next' from the folder, the balancing
    loss the class turns on carried (model.balancing_loss), FP8 and torch.compile reported one line each; the output
    trains 2 steps (with the loss: moe_aux_loss logged)."""
    folder, sft = folder_and_data
    recipe = tmp_path / "sft_qwen3p5.py"
    recipe.write_text(QWEN3P5)
    out = tmp_path / "translated.py"
    proc = from_xtuner(recipe, out, env=recipe_env(folder, sft, NORMAL_MTP_LAYERS="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model.type='qwen3_next', model.hf_path (model_type='qwen3_5_moe_text'" in proc.stderr
    assert "model_cfg.mtp_config=MTPConfig(num_layers=0" in proc.stderr and "{'num_layers': 0," in proc.stderr
    dropped = [line for line in proc.stderr.splitlines() if line.startswith("dropped: ")]
    for field in ("model_cfg.float8_cfg=", "model_cfg.compile_cfg"):
        assert any(line.startswith(f"dropped: {field}") for line in dropped), field
    text = out.read_text()
    assert "'type': 'qwen3_next'" in text and "'checkpoint': 1.0" in text
    assert "'balancing_loss': 'global_batch'" in text and "'moe_loss_coeff': 0.001" in text
    train(tmp_path / "run", "monitor.progress_bar=off", config=out, fast=False)
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2] and all(r["loss"] > 0 for r in records)
    assert all(0 < r["moe_aux_loss"] < 0.01 for r in records)  # alpha 0.001 times about 1 per sparse block


def test_the_recipes_multi_token_prediction_carries_and_trains(folder_and_data, tmp_path):
    """The recipe as shipped (4 MTP depths sharing one layer, λ 1.0): carried onto model.mtp_config with the same
    values; the output trains 2 steps logging mtp_loss (the folder transformers wrote holds no mtp.*: the layer is
    the seed's draw, said in one line)."""
    folder, sft = folder_and_data
    recipe = tmp_path / "sft_qwen3p5.py"
    recipe.write_text(QWEN3P5)
    out = tmp_path / "translated.py"
    proc = from_xtuner(recipe, out, env=recipe_env(folder, sft))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model.mtp_config={'num_layers': 4, 'share_weights': True, 'loss_scaling_factor': 1.0}" in proc.stderr
    train(tmp_path / "run", "monitor.progress_bar=off", config=out, fast=False)
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2] and all(r["mtp_loss"] > 0 for r in records)
