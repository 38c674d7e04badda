"""XTuner v1's DeepSeek-V3 lineage onto the native `deepseek_v3` family (xtuner/deepseek.py): `DeepSeekV3Config` with
`load_from`, and `get_model_config_from_hf` of a DeepSeek-V3 / Kimi-K2 / GLM-4.5 / GLM-4.7-Flash folder, with the
router's bias speed, its balancing loss and its multi-token prediction (`MTPConfig`, the same names; none set: off,
as XTuner trains none) carried, and what the family does not compute (z-loss, an MTP option not built here)
reported one line each (no XTuner installed: the stand-ins record the file's calls)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config, Glm4MoeConfig, Glm4MoeLiteConfig

from internlm_offload.builder.model import build_model
from internlm_offload.config import ModelConfig
from internlm_offload.tools import from_xtuner
from internlm_offload.xtuner.standins import load_trainer
from internlm_offload.xtuner.translate import translate_trainer

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)  # fmt: skip
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
CONFIGS = {
    "deepseek_v3": lambda: DeepseekV3Config(**SMALL, **MLA, first_k_dense_replace=1),
    "kimi_k2": lambda: DeepseekV3Config(**SMALL, **MLA, first_k_dense_replace=1),
    "glm4_moe": lambda: Glm4MoeConfig(**SMALL, num_key_value_heads=2, head_dim=8, first_k_dense_replace=1),
    "glm4_moe_lite": lambda: Glm4MoeLiteConfig(**SMALL, **MLA, num_key_value_heads=4),
}
IMPORTS = """\
from xtuner.v1.config import AdamWConfig
from xtuner.v1.datasets import PretrainTokenizeFunctionConfig
from xtuner.v1.datasets.config import DataloaderConfig, DatasetConfig
from xtuner.v1.model import DeepSeekV3Config, get_model_config_from_hf
from xtuner.v1.model.moe.moe import BalancingLossConfig, ZLossConfig
from xtuner.v1.module.mtp import MTPConfig
from xtuner.v1.module.router.noaux_router import NoAuxRouterConfig
from xtuner.v1.train import TrainerConfig
"""
DATA = "[{'dataset': DatasetConfig(anno_path='/d.jsonl'), 'tokenize_fn': PretrainTokenizeFunctionConfig()}]"
XTUNER_DEFAULT_BALANCING = "model.balancing_loss='global_batch', loss.moe_loss_coeff=0.001"
UNSET_MTP = "model_cfg.mtp_config unset -> model.mtp_config=dict(num_layers=0) (XTuner trains no multi-token prediction"


def folder(tmp_path: Path, model_type: str) -> Path:
    """config.json of a tiny `model_type` folder, as transformers writes it (Kimi-K2's: DeepSeek-V3's, renamed)."""
    path = tmp_path / model_type
    CONFIGS[model_type]().save_pretrained(path)
    if model_type == "kimi_k2":
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    return path


def translate(tmp_path: Path, model_cfg: str, trainer: str = "") -> object:
    path = tmp_path / "cfg.py"
    path.write_text(f"{IMPORTS}model_cfg = {model_cfg}\ntrainer = TrainerConfig(model_cfg=model_cfg, "
                    f"optim_cfg=AdamWConfig(), total_step=2, dataset_cfg={DATA}{trainer})\n")  # fmt: skip
    return translate_trainer(load_trainer(path), path)


@pytest.mark.parametrize("model_type", CONFIGS)
def test_get_model_config_from_hf_with_load_from_maps_onto_the_family(model_type, tmp_path):
    """The folder is the model (its architecture and weights), the bias moves at XTuner's default speed; XTuner's
    DeepSeekV3Config.from_hf adds its global-batch balancing loss (alpha 0.001, carried), GLM's folders add none."""
    path = folder(tmp_path, model_type)
    t = translate(tmp_path, f"get_model_config_from_hf({str(path)!r})", f", load_from={str(path)!r}")
    assert not t.fatal, t.fatal
    balanced = model_type in ("deepseek_v3", "kimi_k2")
    assert t.config["model"] == {"type": "deepseek_v3", "hf_path": str(path), "router_bias_update_speed": 0.001,
                                 "mtp_config": {"num_layers": 0}, "checkpoint": 1.0, "dtype": "torch.bfloat16",
                                 **({"balancing_loss": "global_batch"} if balanced else {})}  # fmt: skip
    assert t.config.get("loss", {}).get("moe_loss_coeff") == (0.001 if balanced else None)
    assert t.config["data"]["tokenizer"] == str(path)
    assert any(f"-> model.type='deepseek_v3', model.hf_path (model_type={model_type!r}" in c for c in t.carried)
    assert any("-> model.router_bias_update_speed=0.001" in line for line in t.carried)
    carried = [line for line in t.carried if line.endswith(XTUNER_DEFAULT_BALANCING)]
    assert len(carried) == int(balanced), t.carried
    assert not t.dropped, t.dropped
    assert sum(line.startswith(UNSET_MTP) for line in t.carried) == 1  # not the folder's num_nextn_predict_layers
    assert ModelConfig(**t.config["model"]).mtp_config.num_layers == 0  # validates as train.py would


def test_deepseek_v3_config_carries_the_router_and_reports_what_is_not_computed(tmp_path):
    path = folder(tmp_path, "deepseek_v3")
    load = f", load_from={str(path)!r}, tokenizer_path='/tok'"
    t = translate(tmp_path, "DeepSeekV3Config(router=NoAuxRouterConfig(router_bias_update_speed=0.0005), "
                  "z_loss_cfg=ZLossConfig(), mtp_config=MTPConfig(num_layers=1))", load)  # fmt: skip
    assert not t.fatal and t.config["model"]["router_bias_update_speed"] == 0.0005
    assert t.config["model"]["hf_path"] == str(path) and t.config["data"]["tokenizer"] == "/tok"
    assert t.config["model"]["mtp_config"] == {"num_layers": 1}
    assert "model_cfg.mtp_config=MTPConfig(num_layers=1) -> model.mtp_config={'num_layers': 1}" in t.carried
    assert [line.split(":")[0] for line in t.dropped] == [
        "model_cfg.z_loss_cfg",
    ]
    # DeepSeekV3Config's default balancing loss carried: XTuner's global-batch one, alpha 0.001
    assert t.config["model"]["balancing_loss"] == "global_batch" and t.config["loss"] == {"moe_loss_coeff": 0.001}
    assert any("(unset: DeepSeekV3Config's default)" in c and c.endswith(XTUNER_DEFAULT_BALANCING) for c in t.carried)
    # balancing off in the file, routers frozen: nothing dropped, no loss, the bias stays as loaded
    t = translate(tmp_path, "DeepSeekV3Config(balancing_loss_cfg=None, freeze_routers=True)", load)
    assert not t.fatal and not t.dropped and t.config["model"]["router_bias_update_speed"] == 0.0
    assert "balancing_loss" not in t.config["model"] and "loss" not in t.config
    assert any("model_cfg.freeze_routers=True -> model.router_bias_update_speed=0" in c for c in t.carried)
    # a balancing loss set on a GLM folder's config: carried too, its alpha and its average
    glm = folder(tmp_path, "glm4_moe")
    balancing = "BalancingLossConfig(balancing_loss_alpha=0.01, balancing_loss_global_average=False)"
    t = translate(tmp_path, f"get_model_config_from_hf({str(glm)!r}, balancing_loss_cfg={balancing})",
                  f", load_from={str(glm)!r}")  # fmt: skip
    assert not t.dropped and t.config["model"]["balancing_loss"] == "micro_batch"
    assert t.config["loss"] == {"moe_loss_coeff": 0.01}
    # alpha 0: XTuner adds a zero loss, here none
    t = translate(tmp_path, "DeepSeekV3Config(balancing_loss_cfg=BalancingLossConfig(balancing_loss_alpha=0.0))", load)
    assert "balancing_loss" not in t.config["model"] and "loss" not in t.config


def test_mtp_config_carries_with_xtuners_names(tmp_path):
    """GLM-5.2's recipe shape (one shared layer for 7 depths) with every MTPConfig field set: the same names and values
    under model.mtp_config, which validates; an option not built here is one dropped line, its defaults none; an
    MTPConfig without num_layers (XTuner requires it) is one fatal line."""
    path = folder(tmp_path, "deepseek_v3")
    load = f", load_from={str(path)!r}"
    fields = dict(num_layers=7, share_weights=True, loss_scaling_factor=0.2, detach_mtp_inputs=True,
                  detach_mtp_lm_head_weight=True)  # fmt: skip
    given = ", ".join(f"{key}={value!r}" for key, value in fields.items())
    mtp = f"MTPConfig(name='mtp', {given}, mask_type=None, loss_type='ce')"
    t = translate(tmp_path, f"DeepSeekV3Config(balancing_loss_cfg=None, mtp_config={mtp})", load)
    assert not t.fatal and not t.dropped and t.config["model"]["mtp_config"] == fields
    assert ModelConfig(**t.config["model"]).mtp_config.model_dump() == fields
    t = translate(tmp_path, f"DeepSeekV3Config(balancing_loss_cfg=None, mtp_config=MTPConfig(num_layers=2, "
                  "mask_type='document', loss_type='e2e_tv'))", load)  # fmt: skip
    assert t.config["model"]["mtp_config"] == {"num_layers": 2}
    assert [line.split(":")[0] for line in t.dropped] == [
        "model_cfg.mtp_config.mask_type='document'",
        "model_cfg.mtp_config.loss_type='e2e_tv'",
    ]
    t = translate(tmp_path, "DeepSeekV3Config(mtp_config=MTPConfig(share_weights=True))", load)
    assert len(t.fatal) == 1 and "no num_layers (XTuner's MTPConfig requires it)" in t.fatal[0]


def test_gpu_only_kernel_choices_are_named_and_the_tv_loss_chunk_is_silent_under_cross_entropy(tmp_path):
    """sft_glm5p2.py's shape: FP8, the token dispatcher and the sparse-attention backends are one dropped line each
    (GPU-only kernels: how a GPU computes the model, not what is trained); `tv_loss_chunk_size` changes nothing while
    the MTP loss is the cross-entropy, and is named once the TV objective is asked for."""
    path = folder(tmp_path, "deepseek_v3")
    cfg = tmp_path / "cfg.py"
    cfg.write_text(
        f"{IMPORTS}from xtuner.v1.float8.config import Float8Config\n"
        f"model_cfg = get_model_config_from_hf({str(path)!r})\n"
        "model_cfg.mtp_config = MTPConfig(num_layers=7, share_weights=True)\n"
        "model_cfg.mtp_config.loss_type = 'ce'\nmodel_cfg.mtp_config.tv_loss_chunk_size = 128\n"
        "model_cfg.dispatcher = 'all2all'\nmodel_cfg.float8_cfg = Float8Config()\n"
        "model_cfg.attention.sparse_mla_backend = 'tilelang'\n"
        f"trainer = TrainerConfig(model_cfg=model_cfg, optim_cfg=AdamWConfig(), total_step=2, dataset_cfg={DATA}, "
        f"load_from={str(path)!r})\n"
    )
    t = translate_trainer(load_trainer(cfg), cfg)
    assert not t.fatal, t.fatal
    assert [line.split(":")[0] for line in t.dropped] == [
        "model_cfg.float8_cfg=Float8Config()",
        "model_cfg.dispatcher='all2all'",
        "model_cfg.attention.sparse_mla_backend='tilelang'",
    ]
    assert all("GPU-only" in line for line in t.dropped)
    cfg.write_text(cfg.read_text().replace("loss_type = 'ce'", "loss_type = 'e2e_tv'"))
    dropped = [line.split(":")[0] for line in translate_trainer(load_trainer(cfg), cfg).dropped]
    assert dropped[:2] == ["model_cfg.mtp_config.loss_type='e2e_tv'", "model_cfg.mtp_config.tv_loss_chunk_size=128"]


def test_without_load_from_the_folders_config_is_built_at_random(tmp_path):
    """As XTuner initialises a model config without weights: config.json's keys as model.hf_config, which builds."""
    path = folder(tmp_path, "glm4_moe_lite")
    t = translate(tmp_path, f"get_model_config_from_hf({str(path)!r})", ", tokenizer_path='/tok'")
    assert not t.fatal, t.fatal
    model = t.config["model"]
    assert model["type"] == "deepseek_v3" and "hf_path" not in model
    assert model["hf_config"] == json.loads((path / "config.json").read_text())
    built = build_model(ModelConfig(**model), torch.device("meta"))
    assert built.args.model_type == "glm4_moe_lite" and built.args.num_layers == 2
    assert any("model.hf_config (model_type='glm4_moe_lite'), initialised at random" in c for c in t.carried)
    t = translate(tmp_path, f"get_model_config_from_hf({str(path)!r})")
    assert [line.split(":")[0] for line in t.fatal] == ["tokenizer_path"]


def test_a_folder_of_another_family_under_deepseek_v3_config_is_one_fatal_line(tmp_path):
    path = tmp_path / "qwen"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    t = translate(tmp_path, "DeepSeekV3Config()", f", load_from={str(path)!r}")
    assert len(t.fatal) == 1 and "model_type='qwen3'; model_cfg=DeepSeekV3Config maps onto" in t.fatal[0]


def test_from_xtuner_writes_a_config_that_validates_with_the_report_on_stderr(tmp_path, capsys):
    path = folder(tmp_path, "kimi_k2")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"content": "hi"}) + "\n")
    config = tmp_path / "sft.py"
    config.write_text(
        f"{IMPORTS}model_cfg = get_model_config_from_hf({str(path)!r})\n"
        "model_cfg.mtp_config = MTPConfig(num_layers=1)\n"
        f"data = [{{'dataset': DatasetConfig(anno_path={str(data)!r}), "
        "'tokenize_fn': PretrainTokenizeFunctionConfig()}]\n"
        "trainer = TrainerConfig(model_cfg=model_cfg, optim_cfg=AdamWConfig(), total_step=2, "
        f"load_from={str(path)!r}, dataloader_cfg=DataloaderConfig(dataset_config_list=data, pack_max_length=64))\n"
    )
    out = tmp_path / "out.py"
    assert from_xtuner.main([str(config), "--out", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len([line for line in err if line.startswith("carried: ") and XTUNER_DEFAULT_BALANCING in line]) == 1
    assert "carried: model_cfg.mtp_config=MTPConfig(num_layers=1) -> model.mtp_config={'num_layers': 1}" in err
    names: dict = {}
    exec(out.read_text(), names)
    assert names["model"]["type"] == "deepseek_v3" and names["model"]["hf_path"] == str(path)
    assert names["model"]["balancing_loss"] == "global_batch" and names["loss"]["moe_loss_coeff"] == 0.001
    assert names["model"]["mtp_config"] == {"num_layers": 1}


def test_xtuners_activation_offload_counts_the_folders_blocks(tmp_path, monkeypatch):
    """`XTUNER_ACTIVATION_OFFLOAD=1` over config.json's `num_hidden_layers` (the section names no `num_layers`)."""
    monkeypatch.setenv("XTUNER_ACTIVATION_OFFLOAD", "1")
    path = folder(tmp_path, "deepseek_v3")
    for trainer in (f", load_from={str(path)!r}", ", tokenizer_path='/tok'"):
        t = translate(tmp_path, f"get_model_config_from_hf({str(path)!r})", trainer)
        assert not t.fatal and t.config["cpu_offloading"] == {"enable": True, "num_layers": 1}, t.dropped
        assert any(line.startswith("XTUNER_ACTIVATION_OFFLOAD=1 -> cpu_offloading.num_layers=1") for line in t.carried)
