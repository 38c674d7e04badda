"""XTuner's Qwen3.5 model configs onto model.type='qwen3_next' (xtuner/qwen3_5.py), through the stand-ins: the
classes and get_model_config_from_hf with load_from, what is reported, what stops in one line."""

from pathlib import Path

from transformers import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig

from internlm_offload.xtuner.standins import load_trainer
from internlm_offload.xtuner.translate import translate_trainer

IMPORTS = """\
from xtuner.v1.config import AdamWConfig
from xtuner.v1.datasets import PretrainTokenizeFunctionConfig
from xtuner.v1.datasets.config import DatasetConfig
from xtuner.v1.model import Qwen3_5_VLMoE35BA3Config, Qwen3_5_VLTextMoE35BA3BConfig, get_model_config_from_hf
from xtuner.v1.model.moe.moe import BalancingLossConfig, MTPConfig
from xtuner.v1.train import TrainerConfig
"""
DATA = "[{'dataset': DatasetConfig(anno_path='/d.jsonl'), 'tokenize_fn': PretrainTokenizeFunctionConfig()}]"


def folder(tmp_path: Path) -> Path:
    path = tmp_path / "qwen3_5_moe"
    Qwen3_5MoeTextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_experts=4).save_pretrained(path)
    return path


def translate(tmp_path: Path, lines: str, path: Path) -> object:
    cfg = tmp_path / "cfg.py"
    cfg.write_text(f"{IMPORTS}{lines}\ntrainer = TrainerConfig(model_cfg=model_cfg, load_from={str(path)!r}, "
                   f"optim_cfg=AdamWConfig(), total_step=2, dataset_cfg={DATA})\n")  # fmt: skip
    return translate_trainer(load_trainer(cfg), cfg)


def test_the_text_class_maps_onto_the_family_and_carries_its_balancing_loss(tmp_path):
    path = folder(tmp_path)
    t = translate(tmp_path, "model_cfg = Qwen3_5_VLTextMoE35BA3BConfig()", path)
    assert not t.fatal, t.fatal
    assert t.config["model"]["type"] == "qwen3_next" and t.config["model"]["hf_path"] == str(path)
    assert any("model.hf_path (model_type='qwen3_5_moe_text'" in line for line in t.carried)
    assert not [line for line in t.dropped if "balancing" in line]
    assert t.config["model"]["balancing_loss"] == "global_batch" and t.config["loss"]["moe_loss_coeff"] == 0.001
    assert any(line.startswith("model_cfg.balancing_loss_cfg (unset: the class's default") for line in t.carried)
    micro = ("model_cfg = Qwen3_5_VLTextMoE35BA3BConfig(balancing_loss_cfg=BalancingLossConfig("
             "balancing_loss_alpha=0.01, balancing_loss_global_average=False))")  # fmt: skip
    t = translate(tmp_path, micro, path)
    assert t.config["model"]["balancing_loss"] == "micro_batch" and t.config["loss"]["moe_loss_coeff"] == 0.01
    t = translate(tmp_path, "model_cfg = Qwen3_5_VLTextMoE35BA3BConfig(balancing_loss_cfg=None)", path)
    assert "balancing_loss" not in t.config["model"] and "moe_loss_coeff" not in t.config.get("loss", {})


def test_get_model_config_from_hf_and_the_vision_language_class(tmp_path):
    path = folder(tmp_path)
    t = translate(tmp_path, f"model_cfg = get_model_config_from_hf({str(path)!r})", path)
    assert not t.fatal and t.config["model"]["type"] == "qwen3_next", t.fatal
    assert not [line for line in t.dropped if "balancing" in line]  # set by nothing in the file
    assert "balancing_loss" not in t.config["model"]
    vl = "model_cfg = Qwen3_5_VLMoE35BA3Config(only_llm_forward=True)\nmodel_cfg.text_config.ep_size = 1"
    t = translate(tmp_path, vl, path)
    assert not t.fatal and any(line.startswith("model_cfg.only_llm_forward=True") for line in t.carried), t.fatal


def test_multi_token_prediction_carries_its_depths(tmp_path):
    """XTuner's MTPConfig onto model.mtp_config with the same values (the DeepSeek lineage's mapping); unset, none;
    more than one physical layer stops in one line (the family builds the folder's one). Red with the depths
    stopped as before, or with the physical-layer check skipped."""
    path = folder(tmp_path)
    text = "model_cfg = Qwen3_5_VLTextMoE35BA3BConfig()\n"
    shared = "model_cfg.mtp_config = MTPConfig(num_layers=4, share_weights=True, loss_scaling_factor=0.5)"
    t = translate(tmp_path, text + shared, path)
    assert not t.fatal, t.fatal
    assert t.config["model"]["mtp_config"] == {"num_layers": 4, "share_weights": True, "loss_scaling_factor": 0.5}
    assert not translate(tmp_path, text + "model_cfg.mtp_config = MTPConfig(num_layers=1)", path).fatal
    t = translate(tmp_path, text.strip(), path)
    assert t.config["model"]["mtp_config"] == {"num_layers": 0}
    assert any("whatever the folder's mtp_num_hidden_layers" in line for line in t.carried)
    t = translate(tmp_path, text + "model_cfg.mtp_config = MTPConfig(num_layers=2)", path)
    assert len(t.fatal) == 1 and "mtp_config.num_layers=2 with share_weights=False: 2 MTP layers" in t.fatal[0]
    assert "\n" not in t.fatal[0]


def test_a_dense_folder_carries_no_balancing_loss(tmp_path):
    """The class's default balancing loss on a dense `qwen3_5_text` folder: no router to balance, said in one line."""
    from transformers import Qwen3_5TextConfig

    path = tmp_path / "qwen3_5"
    Qwen3_5TextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4).save_pretrained(path)
    t = translate(tmp_path, "model_cfg = Qwen3_5_VLTextMoE35BA3BConfig()", path)
    assert not t.fatal and "balancing_loss" not in t.config["model"], t.fatal
    assert any("has no experts: no balancing loss" in line for line in t.carried)


def test_the_vision_language_class_maps_onto_the_text_model_of_a_vision_language_folder(tmp_path):
    """The released folders are vision-language (`qwen3_5_moe`): `load_from` one is the model (its text model trains,
    the vision tower copied through on export); get_model_config_from_hf of one is its `text_config`."""
    path = tmp_path / "qwen3_5_moe_vl"
    text = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4, "num_experts": 4}
    Qwen3_5MoeConfig(text_config=text).save_pretrained(path)
    vl = "model_cfg = Qwen3_5_VLMoE35BA3Config(only_llm_forward=True)"
    t = translate(tmp_path, vl, path)
    assert not t.fatal and t.config["model"]["hf_path"] == str(path), t.fatal
    assert any("model_type='qwen3_5_moe'" in line and "vision tower is not read" in line for line in t.carried)
    cfg = tmp_path / "from_hf.py"
    cfg.write_text(f"{IMPORTS}model_cfg = get_model_config_from_hf({str(path)!r})\ntrainer = TrainerConfig("
                   f"model_cfg=model_cfg, tokenizer_path={str(path)!r}, optim_cfg=AdamWConfig(), total_step=2, "
                   f"dataset_cfg={DATA})\n")  # fmt: skip
    t = translate_trainer(load_trainer(cfg), cfg)
    assert not t.fatal, t.fatal
    hf_config = t.config["model"]["hf_config"]
    assert hf_config["model_type"] == "qwen3_5_moe_text" and hf_config["num_experts"] == 4
