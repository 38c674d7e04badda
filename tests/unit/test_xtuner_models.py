"""XTuner v1's Qwen3 model config classes and `get_model_config_from_hf` onto the native model (no XTuner
installed: the stand-ins record the file's calls)."""

from pathlib import Path

import pytest
from transformers import Qwen3Config, Qwen3MoeConfig

from internlm_offload.config import ModelConfig, intermediate_size
from internlm_offload.model.families.internlm2.hf_config import model_section
from internlm_offload.tools import from_xtuner
from internlm_offload.xtuner.models import ModelClassError, model_from_xtuner
from internlm_offload.xtuner.standins import StandIn, load_trainer
from internlm_offload.xtuner.translate import translate_trainer


def width(model: dict) -> int:
    return intermediate_size(model["hidden_size"], model["mlp_ratio"], model["multiple_of"])


def test_qwen3_moe_30b_a3b_class_maps_to_its_experts_router_and_loss() -> None:
    model, loss, carried = model_from_xtuner(StandIn("Qwen3MoE30BA3Config")())
    ModelConfig(**model)  # validates as train.py would
    assert (model["num_layers"], model["hidden_size"], model["num_attention_heads"]) == (48, 2048, 32)
    assert (model["num_kv_attention_heads"], model["head_dim"], model["qk_norm"]) == (4, 128, True)
    assert (model["num_experts"], model["top_k"], model["moe_type"], width(model)) == (128, 8, "Dropless", 768)
    assert model["moe_layer_kwargs"] == {
        "normalize_expert_weights": True,
        "scoring_func": "softmax",
        "routed_scaling_factor": 1.0,
        "aux_loss_by_layer": True,
    }
    assert "mlp_only_layers" not in model and model["vocab_size"] == 151936 and model["rope_base"] == 1e6
    assert loss == {"moe_loss_coeff": 0.001} and "128 experts top-8" in carried[0]


def test_qwen3_dense_classes_and_the_files_overrides() -> None:
    model, loss, _ = model_from_xtuner(StandIn("Qwen3Dense4BConfig")())
    assert (model["num_layers"], model["hidden_size"], width(model), model["head_dim"]) == (36, 2560, 9728, 128)
    assert model["tie_word_embeddings"] and model["rope_base"] == 5e6 and loss == {} and "num_experts" not in model
    eight, _, _ = model_from_xtuner(StandIn("Qwen3Dense8BConfig")())
    assert (eight["hidden_size"], width(eight), eight["tie_word_embeddings"]) == (4096, 12288, False)
    # keywords, nested MHAConfig / router / balancing loss, and attribute writes, as the stand-ins record them
    cfg = StandIn("Qwen3MoE30BA3Config")(
        num_hidden_layers=3,
        hidden_size=64,
        moe_intermediate_size=32,
        n_routed_experts=4,
        first_k_dense_replace=1,
        intermediate_size=96,
        attention=StandIn("MHAConfig")(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        router=StandIn("GreedyRouterConfig")(norm_topk_prob=False),
        balancing_loss_cfg=StandIn("BalancingLossConfig")(balancing_loss_alpha=0.02),
    )
    cfg.num_experts_per_tok = 2
    small, loss, _ = model_from_xtuner(cfg)
    ModelConfig(**small)
    assert (small["num_experts"], small["top_k"], width(small), small["head_dim"]) == (4, 2, 32, 16)
    assert small["mlp_only_layers"] == [0] and small["dense_intermediate_size"] == 96
    assert small["moe_layer_kwargs"]["normalize_expert_weights"] is False and loss == {"moe_loss_coeff": 0.02}
    with pytest.raises(ModelClassError, match="z_loss_cfg"):
        model_from_xtuner(StandIn("Qwen3MoE30BA3Config")(z_loss_cfg=StandIn("ZLossConfig")()))


def test_get_model_config_from_hf_reads_a_local_qwen3_moe_or_qwen3_folder(tmp_path: Path) -> None:
    common = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    }
    moe = Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=96)
    moe.save_pretrained(tmp_path / "moe")
    model, loss, _ = model_from_xtuner(StandIn("get_model_config_from_hf")(str(tmp_path / "moe")))
    expected = {"type": "internlm2", **model_section(moe.to_dict())}
    expected["moe_layer_kwargs"] = {**expected["moe_layer_kwargs"], "aux_loss_by_layer": True}
    assert model == expected and loss == {"moe_loss_coeff": 0.001}
    assert (model["num_experts"], model["top_k"], model["head_dim"], model["qk_norm"]) == (8, 2, 32, True)
    Qwen3Config(**common, intermediate_size=96, vocab_size=96, rope_theta=1e5).save_pretrained(tmp_path / "dense")
    dense, loss, _ = model_from_xtuner(StandIn("get_model_config_from_hf")(tmp_path / "dense"))
    ModelConfig(**dense)
    assert (dense["num_layers"], dense["head_dim"], dense["qk_norm"], width(dense), dense["rope_base"]) == (
        2, 32, True, 96, 1e5)  # fmt: skip
    assert loss == {} and "num_experts" not in dense


XTUNER_CONFIG = """\
from xtuner.v1.model import {cls}
from xtuner.v1.train import TrainerConfig
trainer = TrainerConfig(model_cfg={cls}(), tokenizer_path="/tok", total_step=2)
"""


def test_a_model_class_in_a_config_translates_and_an_unknown_one_is_one_line_exit_2(tmp_path: Path, capsys) -> None:
    path = tmp_path / "cfg.py"
    path.write_text(XTUNER_CONFIG.format(cls="Qwen3MoE30BA3Config"))
    t = translate_trainer(load_trainer(path), path)
    assert t.config["model"]["num_experts"] == 128 and t.config["loss"] == {"moe_loss_coeff": 0.001}
    assert t.config["data"]["tokenizer"] == "/tok" and not any("model" in line for line in t.fatal)
    path.write_text(XTUNER_CONFIG.format(cls="DeepSeekV3Config"))
    assert from_xtuner.main([str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error:")]
    assert (
        len(errors) == 1
        and "model_cfg=DeepSeekV3Config(...) without load_from: model_cfg=DeepSeekV3Config: not" in errors[0]
    )
    assert "Qwen3MoE30BA3Config" in errors[0]  # what is mapped
