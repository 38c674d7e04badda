"""InternEvo key translation: mapped, ignored and refused keys, one report for every problem."""

import copy
from pathlib import Path

import pytest

from internlm_offload.config import ConfigError, load_config_file, resolve_config
from internlm_offload.config.internevo import translate

SHRUNK = Path(__file__).resolve().parents[1] / "data" / "internevo_7b_sft_shrunk.py"


def test_internevo_config_resolves_with_its_meaning():
    cfg = resolve_config(load_config_file(SHRUNK))
    assert cfg.model.type == "internlm2" and cfg.model.norm_eps == 1e-5 and cfg.model.rope_base == 1e6
    assert cfg.model.dtype == "torch.bfloat16" and cfg.mixed_precision.master_weights
    assert cfg.ckpt.save_ckpt_folder == "llm_ckpts" and cfg.ckpt.auto_resume
    assert cfg.ckpt.load_ckpt_info is None and cfg.ckpt.load_ckpt_folder is None  # auto_resume wins (InternEvo)
    assert cfg.parallel.mode == "none" and cfg.data.type == "builtin"
    notes, warnings = cfg.migration_notes()
    assert any("monitor.alert" in line and "hybrid_zero_optimizer.overlap_sync_grad" in line for line in notes)
    assert any("train_folder=None" in line for line in warnings)


def test_shipped_isp_parallel_settings_keep_their_meaning_and_2d_sequence_parallel_is_refused():
    raw = load_config_file(SHRUNK)
    raw["parallel"] = dict(
        zero1=dict(size=-1),
        tensor=dict(size=2, mode="isp"),
        pipeline=dict(size=1),
        weight=dict(size=4, overlap=True),
        sequence_2D=dict(enable=True),
    )
    with pytest.raises(ConfigError) as info:
        resolve_config(raw, world_size=1)
    report = str(info.value)
    assert "parallel.sequence_2D.enable=True" in report and "ring attention" in report
    del raw["parallel"]["sequence_2D"]
    cfg = resolve_config(raw, world_size=8)  # isp 2 over 8 ranks, weights sharded over groups of 4
    assert cfg.parallel.mode == "fsdp2" and cfg.parallel.tensor.mode == "isp" and cfg.parallel.weight.size == 4


@pytest.mark.parametrize(
    "parallel, world_size, expected",
    [
        (dict(zero1=dict(size=-1)), 2, {"mode": "ddp"}),
        (dict(weight=dict(size=2)), 2, {"mode": "fsdp2", "weight": {"size": 1}}),
        (dict(zero1=dict(size=-1, fsdp=True)), 4, {"mode": "fsdp2"}),
        (dict(zero1=dict(size=1)), 1, {"mode": "none"}),
        # tensor groups keep their section; several data-parallel ranks beside them take FSDP2 (DDP takes no DTensors)
        (
            dict(zero1=dict(size=-1), tensor=dict(size=2, mode="msp")),
            2,
            {"mode": "none", "tensor": {"size": 2, "mode": "msp"}},
        ),
        (
            dict(zero1=dict(size=-1), tensor=dict(size=2, mode="fsp")),
            4,
            {"mode": "fsdp2", "tensor": {"size": 2, "mode": "fsp"}},
        ),
        (dict(tensor=2), 2, {"mode": "none", "tensor": {"size": 2}}),
    ],
)
def test_parallel_sections_map_onto_a_mode(parallel, world_size, expected):
    assert translate({"parallel": parallel}, world_size).config["parallel"] == expected


def test_local_prefixes_and_model_only_load_without_auto_resume():
    raw = {
        "ckpt": dict(
            save_ckpt_folder="local:runs/a",
            load_ckpt_folder="local:old/",
            load_ckpt_info=dict(path="local:runs/pre", content=("model",)),
            auto_resume=False,
        )
    }
    ckpt = translate(raw).config["ckpt"]
    assert ckpt == {
        "save_ckpt_folder": "runs/a",
        "auto_resume": False,
        "load_ckpt_info": {"path": "runs/pre", "content": ("model",)},
    }


@pytest.mark.parametrize(
    "raw, part",
    [
        ({"model_type": "QWEN3MOE", "model": dict(num_experts=4, top_k=2)}, "asserts Dropless"),
        ({"model_type": "GPT9"}, "model_type='GPT9'"),
        ({"adam": dict(adam_beta2_c=0.5)}, "adam.adam_beta2_c=0.5"),
        ({"model": dict(norm_type="layernorm")}, "model.norm_type='layernorm'"),
        ({"data": dict(rampup_batch_size="192 24 8")}, "data.rampup_batch_size"),
        ({"ckpt": dict(save_ckpt_folder="boto3:s3://bucket/x")}, "only local paths"),
        ({"parallel": dict(sequence_2D=dict(enable=True))}, "parallel.sequence_2D.enable=True"),
    ],
)
def test_settings_that_would_change_the_run_are_refused(raw, part):
    with pytest.raises(ConfigError) as info:
        resolve_config(raw)
    assert part in str(info.value)


def test_typos_are_still_refused_with_a_hint_from_the_same_section():
    with pytest.raises(ConfigError) as info:
        resolve_config({"model": dict(norm_eps=1e-5, num_layer=3)})
    assert "did you mean 'model.num_layers'" in str(info.value)


def test_schedule_length_mismatch_warns():
    cfg = resolve_config({"data": dict(total_steps=10), "lr_scheduler": dict(total_steps=50000)})
    assert any("will not finish" in line for line in cfg.migration_notes()[1])


def test_label_smoothing_reaches_the_schema():
    assert (
        resolve_config({"loss": dict(label_smoothing=0.1, op_type="flash_vocab_parallel")}).loss.label_smoothing == 0.1
    )


def test_load_ckpt_info_wins_over_the_legacy_folder_as_in_internevo():
    cfg = resolve_config({"ckpt": {"load_ckpt_folder": "a", "load_ckpt_info": {"path": "b"}}})
    assert cfg.ckpt.load_ckpt_folder is None and cfg.ckpt.load_ckpt_info.path == "b"
    assert any("legacy ckpt.load_ckpt_folder is not loaded" in line for line in cfg.migration_notes()[0])


def test_tokenized_folders_select_internevo_data_with_its_defaults():
    raw = load_config_file(SHRUNK)
    raw["data"].update(train_folder="/data/train", valid_folder="/data/valid", skip_batches="3-5,8")
    cfg = resolve_config(raw)
    data = cfg.data
    assert data.type == "internevo" and data.pack_sample_into_one is False  # InternEvo's default
    assert data.valid_folder == "/data/valid" and data.valid_every == raw["data"]["valid_every"]
    assert data.skip_ranges() == [(3, 5), (8, 8)]


def test_no_validation_folder_turns_valid_every_off_with_a_warning():
    raw = load_config_file(SHRUNK)
    raw["data"].update(valid_folder=None, valid_every=50)
    cfg = resolve_config(raw)
    assert cfg.data.valid_every == 0
    assert any("valid_folder=None: no validation" in line for line in cfg.migration_notes()[1])


@pytest.mark.parametrize(
    "data, message",
    [
        (dict(skip_batches="5-3"), "data.skip_batches='5-3': ranges must be ascending"),
        (dict(skip_batches="1,x"), "data.skip_batches='1,x': 'x' is not N or N-M"),
        (dict(valid_every=2), "data.valid_every=2 needs data.valid_folder"),
        (dict(type="text", paths=["a.txt"], train_folder="/d"), "data.train_folder is read by data.type='internevo'"),
        (dict(pack_sample_into_one=False), "data.pack_sample_into_one=False (documents kept apart) needs"),
        (dict(type="internevo"), "data.type='internevo' needs data.train_folder"),
    ],
)
def test_bad_data_settings_are_one_line_each(data, message):
    with pytest.raises(ConfigError) as info:
        resolve_config({"data": data})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_internevo_moe_config_maps_and_its_legacy_moe_section_is_one_line():
    """An InternEvo MoE config trains on the native MoE blocks (tests/unit/test_internevo_moe.py); its older
    top-level `moe=dict(...)` section is not read: one line naming where its keys go."""
    raw = load_config_file(SHRUNK)
    raw["model_type"] = "INTERNLM_MoE"
    raw["model"].update(num_experts=4, top_k=2, moe_use_residual=True, moe_type="GShard")
    raw["loss"]["moe_loss_coeff"] = 0.1
    cfg = resolve_config(copy.deepcopy(raw))
    assert (cfg.model.num_experts, cfg.model.num_shared_experts, cfg.loss.moe_loss_coeff) == (4, 1, 0.1)
    raw["moe"] = dict(top_k=2, capacity_factor=1.0, use_fused_gating=False)
    with pytest.raises(ConfigError) as info:
        resolve_config(raw)
    report = str(info.value)
    assert "\n" not in report and "moe=dict(...): InternEvo's older MoE section is not read" in report


def test_hf_weights_through_load_ckpt_info_load_into_the_native_model():
    """InternEvo's `ckpt_type="hf"` names a Hugging Face folder the native model starts from (storage prefix
    dropped); only the native model takes it: an hf_causal_lm run names its folder as model.hf_path."""
    raw = load_config_file(SHRUNK)
    raw["ckpt"].update(
        auto_resume=False, load_ckpt_info=dict(path="local:/w/internlm3", content=("model",), ckpt_type="hf")
    )
    info = resolve_config(copy.deepcopy(raw)).ckpt.load_ckpt_info
    assert (info.path, info.ckpt_type, info.content) == ("/w/internlm3", "hf", ["model"])
    raw.pop("model_type", None)
    raw["model"] = dict(type="hf_causal_lm", hf_path="/w/internlm3")
    with pytest.raises(ConfigError, match="ckpt_type='hf' loads into model.type='internlm2'; .* model.hf_path"):
        resolve_config(raw)


@pytest.mark.parametrize(
    "model_type, no_bias, bias",
    [("INTERNLM", None, True), ("INTERNLM", True, True), ("INTERNLM2", None, False), ("INTERNLM2", False, True)],
)
def test_internevo_biases_and_swiglu_width_are_internevos(model_type, no_bias, bias):
    """InternLM v1's attention always has biases (InternEvo ignores its no_bias), InternLM2's unless `no_bias`;
    InternEvo's SwiGLU width rounds to 256."""
    model = {"num_layers": 2, "hidden_size": 96, "num_attention_heads": 4, "mlp_ratio": 8 / 3}
    if no_bias is not None:
        model["no_bias"] = no_bias
    cfg = resolve_config({"model_type": model_type, "model": model})
    assert cfg.model.attention_bias is bias and cfg.model.multiple_of == 256
    assert resolve_config({"model_type": model_type, "model": {**model, "multiple_of": 64}}).model.multiple_of == 64


def test_internevo_tensorboard_switches_turn_tensorboard_on():
    cfg = resolve_config(load_config_file(SHRUNK))  # monitor.tensorboard=dict(queue_max_length=10)
    assert cfg.monitor.tensorboard is True
    assert (
        resolve_config({"enable_tb": False, "monitor": {"tensorboard": {"queue_max_length": 1}}}).monitor.tensorboard
        is False
    )
    assert resolve_config({"enable_tb": True, "tensorboard_folder": "local:/tb"}).monitor.tensorboard is True


def test_internevo_develop_infrastructure_keys_are_ignored_by_name():
    """Keys InternEvo's 2025 develop configs carry that change no numerics here (kernels, buffers, loading)."""
    raw = {"use_apex_adam": False, "model": {"mlp_layer_fusion": True}, "data": {"use_shm": False},
           "hybrid_zero_optimizer": {"use_split_tensor_optim": False, "all_gather_size": 512 * 1024 * 1024}}  # fmt: skip
    t = translate(raw)
    assert not t.refused and set(t.ignored) == {
        "use_apex_adam", "model.mlp_layer_fusion", "data.use_shm",
        "hybrid_zero_optimizer.use_split_tensor_optim", "hybrid_zero_optimizer.all_gather_size",
    }  # fmt: skip
    resolve_config(raw)


def test_an_internevo_config_without_model_type_is_internlm_v1_as_in_internevo():
    """7B_sft.py names no model_type: InternEvo builds InternLM v1 (attention biases, width rounded to 256)."""
    raw = load_config_file(SHRUNK)
    raw.pop("model_type")
    cfg = resolve_config(raw)
    assert cfg.model.type == "internlm2" and cfg.model.attention_bias and cfg.model.multiple_of == 256
    assert not resolve_config({"model": {"num_layers": 2}}).model.attention_bias  # this trainer's own configs


@pytest.mark.parametrize("key", ["norm_head", "use_sliding_window"])
def test_internevo_model_features_not_built_here_are_refused_when_on(key):
    with pytest.raises(ConfigError, match=f"model.{key}=True"):
        resolve_config({"model_type": "INTERNLM2", "model": {key: True}})
    resolve_config({"model_type": "INTERNLM2", "model": {key: False}})


def test_internevo_decoder_shape_switches_are_mapped_or_refused():
    """The llama / InternLM3 / Qwen configs' switches: qkv and o biases together are attention_bias, apart they
    are qkv_bias and o_bias (Qwen2's); a head_dim that is hidden / heads and use_swiglu=True change nothing, another
    head_dim is the model's (Qwen3's); the rest would change the model and is refused."""
    model = {"num_layers": 2, "hidden_size": 96, "num_attention_heads": 4}
    same = {**model, "qkv_bias": True, "o_bias": True, "head_dim": 24, "use_swiglu": True, "add_unit_offset": False}
    t = translate({"model_type": "LLAMA2", "model": same, "data": {"use_packed_dataset": True}})
    assert not t.refused and "model.head_dim=24 (hidden_size / num_attention_heads)" in t.ignored
    assert {f"model.{key} (what the decoder here is)" for key in ("use_swiglu=True", "add_unit_offset=False")} <= set(
        t.ignored
    )
    assert resolve_config({"model_type": "LLAMA2", "model": same}).model.attention_bias is True
    qwen2 = resolve_config({"model_type": "LLAMA2", "model": {**same, "o_bias": False}}).model
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.attention_bias) == (True, False, False)
    assert resolve_config({"model_type": "LLAMA2", "model": {**same, "head_dim": 32}}).model.head_dim == 32
    refused = {
        "add_unit_offset": "model.add_unit_offset=True",
        "use_swiglu": "model.use_swiglu=False",
    }
    changed = {"add_unit_offset": True, "use_swiglu": False}
    for key, part in refused.items():
        with pytest.raises(ConfigError) as err:
            resolve_config({"model_type": "LLAMA2", "model": {**same, key: changed[key]}})
        assert part in str(err.value) and str(err.value).count("\n") == 0, str(err.value)
    with pytest.raises(ConfigError, match="data.use_packed_dataset=False: samples are packed"):
        resolve_config({"data": {"use_packed_dataset": False}})
