"""XTuner v1's GPT-OSS configs onto the native `gpt_oss` family (xtuner/gpt_oss.py): the named classes with their
overrides as config.json's keys (built at random), `get_model_config_from_hf` / `load_from` of a folder as the folder,
what the family does not build one fatal line, XTuner's balancing loss carried onto model.balancing_loss (no XTuner
installed: the stand-ins record the file's calls)."""

import json
from pathlib import Path

import pytest
import torch

from internlm_offload.builder.model import build_model
from internlm_offload.config import ModelConfig
from internlm_offload.tools import from_xtuner
from internlm_offload.xtuner.standins import load_trainer
from internlm_offload.xtuner.translate import translate_trainer

IMPORTS = """\
from xtuner.v1.config import AdamWConfig
from xtuner.v1.datasets import PretrainTokenizeFunctionConfig
from xtuner.v1.datasets.config import DataloaderConfig, DatasetConfig
from xtuner.v1.model import GptOss21BA3P6Config, GptOss117BA5P8Config, GptOssConfig, get_model_config_from_hf
from xtuner.v1.model.moe.moe import BalancingLossConfig
from xtuner.v1.module.attention import MHAConfig
from xtuner.v1.module.router.greedy import GreedyRouterConfig
from xtuner.v1.train import TrainerConfig
"""
DATA = "[{'dataset': DatasetConfig(anno_path='/d.jsonl'), 'tokenize_fn': PretrainTokenizeFunctionConfig()}]"
# gpt-oss-20b's class made tiny by keyword overrides, as a recipe that tries the model small first would
TINY = ("GptOss21BA3P6Config(vocab_size=259, num_hidden_layers=2, hidden_size=64, moe_intermediate_size=32, "
        "n_routed_experts=4, attention=MHAConfig(with_sink=True, num_attention_heads=4, num_key_value_heads=2, "
        "head_dim=16, sliding_window=8, qkv_bias=True, o_bias=True, rms_norm_eps=1e-5){extra})")  # fmt: skip
BALANCING = (
    "model_cfg.balancing_loss_cfg (unset: XTuner's default on every MoE config) (balancing_loss_alpha=0.001, "
    "balancing_loss_global_average=True) -> model.balancing_loss='global_batch', loss.moe_loss_coeff=0.001"
)


def translate(tmp_path: Path, model_cfg: str, trainer: str = ", tokenizer_path='/tok'") -> object:
    path = tmp_path / "cfg.py"
    path.write_text(f"{IMPORTS}model_cfg = {model_cfg}\ntrainer = TrainerConfig(model_cfg=model_cfg, "
                    f"optim_cfg=AdamWConfig(), total_step=2, dataset_cfg={DATA}{trainer})\n")  # fmt: skip
    return translate_trainer(load_trainer(path), path)


@pytest.mark.parametrize("name, blocks, experts", [("GptOss117BA5P8Config", 36, 128), ("GptOss21BA3P6Config", 24, 32)])
def test_the_named_classes_are_the_releases_at_random(tmp_path, name, blocks, experts):
    """A named class without load_from: config.json's keys of the release (gpt-oss-120b / 20b: 2880 wide, 64 query
    heads of 64 and 8 kv heads, 128-token windows, top-4, YaRN x32 from 4096, the clamped SwiGLU's 1.702 / 7) as
    model.hf_config, built on meta; XTuner's default balancing loss carried (global batch, alpha 0.001)."""
    t = translate(tmp_path, f"{name}()")
    assert not t.fatal, t.fatal
    model = t.config["model"]
    assert model["type"] == "gpt_oss" and "hf_path" not in model
    built = build_model(ModelConfig(**model), torch.device("meta")).args
    assert (built.num_layers, built.num_local_experts, built.num_experts_per_tok) == (blocks, experts, 4)
    assert (built.hidden_size, built.intermediate_size, built.num_attention_heads, built.num_key_value_heads) == (
        2880, 2880, 64, 8)  # fmt: skip
    assert (built.head_dim, built.sliding_window, built.vocab_size) == (64, 128, 201088)
    assert (built.swiglu_alpha, built.swiglu_limit, built.attention_bias) == (1.702, 7.0, True)
    assert built.rope_parameters["factor"] == 32.0 and built.rope_parameters["truncate"] is False
    assert not t.dropped and BALANCING in t.carried
    assert model["balancing_loss"] == "global_batch" and t.config["loss"]["moe_loss_coeff"] == 0.001


@pytest.mark.parametrize(
    "balancing, kind, alpha",
    [
        ("BalancingLossConfig(balancing_loss_global_average=False, balancing_loss_alpha=0.01)", "micro_batch", 0.01),
        ("BalancingLossConfig(balancing_loss_alpha=0.0)", None, None),
        ("None", None, None),
    ],
    ids=["micro batch", "alpha 0", "none"],
)
def test_xtuners_balancing_loss_carries(tmp_path, balancing, kind, alpha):
    t = translate(tmp_path, TINY.format(extra=f", balancing_loss_cfg={balancing}"))
    assert not t.fatal and not t.dropped, (t.fatal, t.dropped)
    assert t.config["model"].get("balancing_loss") == kind
    assert t.config.get("loss", {}).get("moe_loss_coeff") == alpha


def test_a_recipe_in_xtuners_shape_translates_and_validates(tmp_path, capsys):
    """`python -m internlm_offload.tools.from_xtuner recipe.py --out cfg.py` exits 0 on a GPT-OSS recipe (the 20b class
    made tiny, XTuner's default balancing loss on): the written config builds the overridden sizes, names the loss."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"content": "hi"}) + "\n")
    recipe = tmp_path / "sft_gpt_oss.py"
    recipe.write_text(
        f"{IMPORTS}model_cfg = {TINY.format(extra='')}\n"
        f"data = [{{'dataset': DatasetConfig(anno_path={str(data)!r}), "
        "'tokenize_fn': PretrainTokenizeFunctionConfig()}]\n"
        "trainer = TrainerConfig(model_cfg=model_cfg, optim_cfg=AdamWConfig(), total_step=2, tokenizer_path='/tok', "
        "dataloader_cfg=DataloaderConfig(dataset_config_list=data, pack_max_length=64))\n"
    )
    out = tmp_path / "out.py"
    assert from_xtuner.main([str(recipe), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "model_cfg=GptOss21BA3P6Config(...) -> model.type='gpt_oss', model.hf_config (2 blocks, 4 experts" in err
    names: dict = {}
    exec(out.read_text(), names)
    built = build_model(ModelConfig(**names["model"]), torch.device("meta")).args
    assert (built.num_layers, built.hidden_size, built.intermediate_size, built.num_local_experts) == (2, 64, 32, 4)
    assert (built.num_attention_heads, built.num_key_value_heads, built.head_dim, built.sliding_window) == (4, 2, 16, 8)
    assert names["model"]["balancing_loss"] == "global_batch" and names["loss"]["moe_loss_coeff"] == 0.001


def test_a_folder_is_the_model(tmp_path):
    """`get_model_config_from_hf(folder)` with `load_from` the folder: model.hf_path; without it, its config.json
    as model.hf_config; `GptOssConfig()` with a folder of another family: one fatal line."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "gpt_oss"
    transformers.GptOssConfig(num_hidden_layers=2, hidden_size=64, num_local_experts=4).save_pretrained(folder)
    t = translate(tmp_path, f"get_model_config_from_hf({str(folder)!r})", f", load_from={str(folder)!r}")
    assert not t.fatal and t.config["model"]["hf_path"] == str(folder), t.fatal
    assert t.config["data"]["tokenizer"] == str(folder)
    t = translate(tmp_path, f"get_model_config_from_hf({str(folder)!r})")
    assert not t.fatal and t.config["model"]["hf_config"] == json.loads((folder / "config.json").read_text())
    other = tmp_path / "qwen"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    t = translate(tmp_path, "GptOssConfig()", f", load_from={str(other)!r}")
    assert (
        len(t.fatal) == 1 and "model_type='qwen3'; model_cfg=GptOssConfig maps onto model.type='gpt_oss'" in t.fatal[0]
    )


@pytest.mark.parametrize(
    "extra, fatal",
    [
        (", gate_bias=False", "model_cfg.gate_bias=False"),
        (", moe_bias=False", "model_cfg.moe_bias=False"),
        (", router=GreedyRouterConfig(scoring_func='sigmoid')", "model_cfg.router.scoring_func='sigmoid'"),
    ],
)
def test_what_the_family_does_not_build_is_one_fatal_line(tmp_path, extra, fatal):
    t = translate(tmp_path, TINY.format(extra=extra))
    assert len(t.fatal) == 1 and fatal in t.fatal[0], t.fatal


def test_no_sinks_is_one_fatal_line(tmp_path):
    t = translate(tmp_path, TINY.format(extra="").replace("with_sink=True", "with_sink=False"))
    assert len(t.fatal) == 1 and "model_cfg.attention.with_sink=False" in t.fatal[0], t.fatal
