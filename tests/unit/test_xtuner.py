"""XTuner v1 configs without XTuner: the stand-ins record what the file builds, and the mapping fills XTuner's
defaults and names what it cannot carry."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from internlm_offload.config import ConfigError, resolve_config
from internlm_offload.xtuner import translate
from internlm_offload.xtuner.standins import Recorded, field, kind, load_trainer
from internlm_offload.xtuner.translate import Translation, translate_trainer

CONFIG = """\
import os
from xtuner.v1.config import AdamWConfig, FSDPConfig
from xtuner.v1.train import TrainerConfig
from xtuner.v1.model import get_model_config_from_hf

model_cfg = get_model_config_from_hf("/nowhere")
model_cfg.text_config.ep_size = int(os.environ.get("EP_SIZE", "4"))
trainer = TrainerConfig(model_cfg=model_cfg, optim_cfg=AdamWConfig(lr=2e-5), fsdp_cfg=FSDPConfig(tp_size=2), total_step=5)
"""


def test_the_file_runs_with_recorders_and_leaves_no_xtuner_module_behind(tmp_path: Path) -> None:
    path = tmp_path / "cfg.py"
    path.write_text(CONFIG)
    trainer = load_trainer(path)
    assert kind(trainer) == "TrainerConfig" and field(trainer, "total_step") == 5
    optim = field(trainer, "optim_cfg")
    assert isinstance(optim, Recorded) and kind(optim) == "AdamWConfig" and field(optim, "lr") == 2e-5
    assert field(optim, "betas", (0.9, 0.95)) == (0.9, 0.95)  # unset: the default asked for
    model = field(trainer, "model_cfg")
    assert model.args == ("/nowhere",) and model.text_config.ep_size == 4  # a mutation is recorded
    assert not [name for name in sys.modules if name == "xtuner" or name.startswith("xtuner.")]


def test_xtuners_defaults_fill_the_mapping_and_the_problems_are_named(tmp_path: Path) -> None:
    path = tmp_path / "cfg.py"
    path.write_text(CONFIG)
    t = translate_trainer(load_trainer(path), path)
    assert t.config["adam"] == {
        "lr": 2e-5,
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "adam_eps": 1e-8,
        "weight_decay": 0.01,
    }
    assert t.config["lr_scheduler"] == {"type": "constant", "eta_min": 1e-6, "warmup_ratio": 0.03}
    assert t.config["model"]["checkpoint"] == 1.0  # FSDPConfig's recompute_ratio default
    assert t.config["parallel"]["tensor"] == {"size": 2, "mode": "mtp"}  # kept: the fatal problems stop it anyway
    assert any("without load_from" in line for line in t.fatal) and any("no dataset" in line for line in t.fatal)


def test_xtuners_minus_one_intervals_and_an_uncountable_epoch_are_handled(tmp_path: Path) -> None:
    path = tmp_path / "cfg.py"
    path.write_text(
        CONFIG.replace(
            "total_step=5", "total_epoch=1, checkpoint_interval=-1, checkpoint_maxkeep=-1, load_from='/nowhere'"
        )
    )
    t = translate_trainer(load_trainer(path), path)
    assert t.config["ckpt"]["checkpoint_every"] == 0 and t.config["ckpt"]["keep_last"] == 0
    assert any("load_from='/nowhere'" in line for line in t.fatal)
    assert not any("neither total_step nor total_epoch" in line for line in t.fatal)


def test_a_real_xtuner_objects_defaults_are_not_reported_as_dropped(tmp_path: Path) -> None:
    """XTuner's configs are pydantic models: a field they default is not the user's choice (`model_fields_set`)."""
    from pydantic import BaseModel

    class AdamWConfig(BaseModel):  # shaped as xtuner.v1.config's, with defaults the report would name
        lr: float = 1e-5
        foreach: bool | None = False

    class FSDPConfig(BaseModel):
        torch_compile: bool = True
        ep_size: int = 1

    class TrainerConfig(BaseModel):
        optim_cfg: AdamWConfig
        fsdp_cfg: FSDPConfig | None = None
        total_step: int | None = None
        hf_interval: int | None = 500
        hf_max_keep: int | None = 2
        profile_step: int | None = None
        profile_time: bool = True
        profile_memory: bool = False

    trainer = TrainerConfig(
        optim_cfg=AdamWConfig(lr=2e-5), fsdp_cfg=FSDPConfig(), total_step=5, hf_max_keep=3, profile_step=3
    )
    trainer.profile_memory = True  # an assignment is the user's too
    t = translate_trainer(trainer, tmp_path / "cfg.py")
    assert t.config["adam"]["lr"] == 2e-5 and t.config["data"]["total_steps"] == 5
    assert t.config["monitor"]["profile_step"] == 3
    assert [line.split(":")[0] for line in t.dropped] == ["hf_max_keep=3", "profile_memory=True"]


def test_stand_ins_take_union_annotations() -> None:
    """`def f() -> Float8Config | None` evaluates its annotation when the config file runs."""
    from internlm_offload.xtuner.standins import StandIn

    cls = StandIn("Float8Config")
    assert repr(cls | None) == "Float8Config | None" and repr(None | cls) == "None | Float8Config"
    assert repr(cls | StandIn("MuonConfig") | int) == "Float8Config | MuonConfig | int"


def test_router_bias_experts_train_as_hf_causal_lm_with_xtuners_bias_speed(tmp_path: Path) -> None:
    """DeepSeek-V3 / GLM folders (router-bias experts) train as hf_causal_lm with the bias moved at XTuner's speed
    (its default, or the model config's router); an aux-loss MoE trains as hf_causal_lm; a vision-language folder is
    fatal and named."""
    import json

    bias = {"n_routed_experts": 8}
    cases = (("deepseek_v3", bias, "", 0.001), ("glm4_moe", bias, "router_bias_update_speed=0.0005", 0.0005),
             ("qwen3_moe", {"num_experts": 8, "output_router_logits": False}, "", None),
             ("qwen3_5_moe", {"vision_config": {}, "text_config": {}}, "", "fatal"))  # fmt: skip
    for model_type, keys, router, speed in cases:
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": model_type, **keys}))
        path = tmp_path / f"{model_type}.py"
        text = CONFIG.replace("total_step=5", f"total_step=5, load_from={str(folder)!r}")
        if router:
            text = text.replace(
                'model_cfg = get_model_config_from_hf("/nowhere")',
                f'model_cfg = get_model_config_from_hf("/nowhere", router=NoAuxRouterConfig({router}))',
            )
            text = text.replace("from xtuner.v1.model import", "from xtuner.v1.module.router import NoAuxRouterConfig\n"
                                "from xtuner.v1.model import")  # fmt: skip
        path.write_text(text)
        t = translate_trainer(load_trainer(path), path)
        named = [line for line in t.fatal if f"model_type={model_type!r} is not built here" in line]
        assert len(named) == int(speed == "fatal"), t.fatal
        if speed == "fatal":
            assert "vision-language" in named[0]
            continue
        expected = {"type": "hf_causal_lm", "hf_path": str(folder), "checkpoint": 1.0, "dtype": "torch.bfloat16"}
        if speed is not None:
            expected["router_bias_update_speed"] = speed
        assert t.config["model"] == expected, t.config["model"]
        assert any("-> model.router_bias_update_speed" in line for line in t.carried) == (speed is not None)


def layout(model: dict, **fsdp: int) -> Translation:
    """A translation holding `model` and XTuner's layout `fsdp` (tp_size, ep_size; sp_size as the trainer's) mapped."""
    sp = fsdp.pop("sp_size", 1)
    trainer = SimpleNamespace(fsdp_cfg=SimpleNamespace(**fsdp), sp_size=sp)
    t = Translation(config={"model": model})
    translate._fsdp(t, trainer)
    translate._sequence_parallel(t, trainer)
    translate._check_layout(t)
    return t


DENSE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_attention_heads": 2, "vocab_size": 32}


def test_xtuners_tensor_sequence_and_expert_groups_carry_where_the_model_takes_them():
    """tp_size -> mtp, sp_size -> isp (Ulysses), ep_size -> parallel.expert.size on a model with experts; on a dense
    model ep_size is dropped with the reason (each rank then holds its FSDP shard, as XTuner's would); tp and sp
    together are one fatal line. Red with every group kept (the dense translation would not validate)."""
    moe = layout({**DENSE, "num_experts": 4, "top_k": 2}, ep_size=2)
    assert moe.config["parallel"]["expert"] == {"size": 2} and any("fsdp_cfg.ep_size=2 ->" in c for c in moe.carried)
    dense = layout(dict(DENSE), ep_size=2)
    assert "expert" not in dense.config["parallel"]
    assert dense.dropped == [
        "fsdp_cfg.ep_size=2: parallel.expert.size=2 needs a mixture-of-experts model (model.num_experts > 0)"
    ]
    assert not any("ep_size" in line for line in dense.carried)
    assert layout(dict(DENSE), tp_size=2).config["parallel"]["tensor"] == {"size": 2, "mode": "mtp"}
    assert layout(dict(DENSE), sp_size=2).config["parallel"]["tensor"] == {"size": 2, "mode": "isp"}
    both = layout(dict(DENSE), tp_size=2, sp_size=2)
    assert both.fatal == ["sp_size=2 with fsdp_cfg.tp_size=2: one tensor group here; choose one"]


def test_a_chunked_loss_is_carried_as_the_loss_here_is_chunked_already():
    t = Translation()
    translate._loss(t, SimpleNamespace(loss_cfg=SimpleNamespace(mode="chunk", chunk_size=1024)))
    assert not t.dropped and t.carried[0].startswith(
        "loss_cfg.mode='chunk' (chunk_size=1024): the loss here is chunked"
    )


MUON_CONFIG = CONFIG.replace("AdamWConfig, FSDPConfig", "FSDPConfig, MuonConfig").replace(
    "optim_cfg=AdamWConfig(lr=2e-5)", "optim_cfg=MuonConfig(lr=2e-4, momentum=0.9, flatten=True)"
)


def test_muon_config_maps_to_the_muon_switch_and_names_what_differs(tmp_path: Path) -> None:
    path = tmp_path / "cfg.py"
    path.write_text(MUON_CONFIG)
    t = translate_trainer(load_trainer(path), path)
    assert t.config["optimizer"] == {
        "type": "muon",
        "muon": {"momentum": 0.9, "nesterov": True, "eps": 1e-8, "adjust_lr_fn": "match_rms_adamw",  # rms_norm
                 "clip_grad": False},  # XTuner's: Muon's gradients in the norm, not scaled
    }  # fmt: skip
    assert t.config["adam"] == {"lr": 2e-4, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8,
                                "weight_decay": 0.1}  # fmt: skip
    assert any("five distinct coefficient triples" in line for line in t.dropped)
    assert any(line.startswith("optim_cfg.flatten=True") for line in t.dropped)
    cfg = resolve_config({"optimizer": t.config["optimizer"], "adam": t.config["adam"]})
    assert cfg.optimizer.muon.adjust_lr_fn == "match_rms_adamw" and cfg.optimizer.muon.clip_grad is False
    parallel = {"mode": t.config["parallel"]["mode"]}  # XTuner's FSDP (the CONFIG's tp_size: a tensor group here)
    assert resolve_config({"optimizer": t.config["optimizer"], "parallel": parallel})
    assert resolve_config({"optimizer": t.config["optimizer"], "parallel": parallel, "swap_optimizer": True})
    with pytest.raises(ConfigError, match="parallel.mode='fsdp2' and hybrid_optimizer"):  # not gathered there yet
        resolve_config({"optimizer": t.config["optimizer"], "parallel": parallel, "hybrid_optimizer": {"enable": True}})


def test_muon_config_with_an_lr_adjustment_not_built_here_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cfg.py"
    path.write_text(MUON_CONFIG.replace("flatten=True", "adjust_lr='none'"))
    t = translate_trainer(load_trainer(path), path)
    assert any("optim_cfg.adjust_lr='none'" in line for line in t.fatal)
