"""Unit tests for internlm_offload.config: loading (`_base_`, overrides), derived values and every error path."""

import argparse
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from internlm_offload.config import ConfigError, ModelConfig, RunConfig, load_config_file, resolve_config
from internlm_offload.config.sections import AdamConfig, CpuOffloadingConfig, HybridOptimizerConfig
from internlm_offload.offload import make_layer_plan

REPO = Path(__file__).resolve().parents[2]
SHIPPED_CONFIGS = sorted((REPO / "configs").glob("*.py"))


def write(path: Path, text: str) -> Path:
    """Write a config file (dedented), creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def config_error(raw: dict[str, Any], world_size: int = 1) -> str:
    """The message of the ConfigError that resolving `raw` raises; it must be a single line."""
    with pytest.raises(ConfigError) as info:
        resolve_config(raw, world_size=world_size)
    message = str(info.value)
    assert "\n" not in message and message.strip() == message and message
    return message


def parse_cfg_options(*options: str) -> dict[str, Any]:
    """Parse `key=value` strings exactly as train.py's `--cfg-options` does (mmengine DictAction)."""
    from mmengine.config import DictAction

    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg-options", nargs="+", action=DictAction, default={})
    return parser.parse_args(["--cfg-options", *options]).cfg_options


# ---------------------------------------------------------------- _base_ inheritance and overrides


@pytest.fixture
def inherited(tmp_path: Path) -> Path:
    """A child in exp/ inheriting two bases in _base_/, one of which inherits a base of its own."""
    write(
        tmp_path / "_base_" / "common" / "runtime.py",
        """
        seed = 1
        ckpt = dict(checkpoint_every=5, keep_last=3)
        """,
    )
    write(
        tmp_path / "_base_" / "model.py",
        """
        _base_ = "./common/runtime.py"  # relative to this base, not to the child
        model = dict(num_layers=2, hidden_size=64, num_attention_heads=4, dtype="torch.float32")
        """,
    )
    write(
        tmp_path / "_base_" / "data.py",
        """
        data = dict(seq_len=32, micro_bsz=1, paths=["a.txt", "b.txt"], type="text")
        adam = dict(lr=1e-3, weight_decay=0.1)
        """,
    )
    return write(
        tmp_path / "exp" / "child.py",
        """
        _base_ = ["../_base_/model.py", "../_base_/data.py"]
        seed = 7
        model = dict(num_layers=3, checkpoint=0.5)
        data = dict(paths=["c.txt"])
        adam = dict(_delete_=True, lr=5e-4)
        """,
    )


def test_base_dicts_merge_and_child_wins(inherited: Path) -> None:
    raw = load_config_file(inherited)
    assert "_base_" not in raw
    assert raw["seed"] == 7  # child scalar beats the base-of-base
    model = dict(num_layers=3, hidden_size=64, num_attention_heads=4, dtype="torch.float32", checkpoint=0.5)
    assert raw["model"] == model
    assert raw["ckpt"] == dict(checkpoint_every=5, keep_last=3)  # from the base of a base
    assert raw["data"]["paths"] == ["c.txt"]  # lists are replaced, not concatenated
    assert raw["data"]["seq_len"] == 32 and raw["data"]["type"] == "text"
    assert raw["adam"] == dict(lr=5e-4)  # _delete_ replaces the whole dict


def test_base_inherited_config_resolves(inherited: Path) -> None:
    cfg = resolve_config(load_config_file(inherited))
    assert (cfg.seed, cfg.model.num_layers, cfg.model.hidden_size, cfg.model.checkpoint) == (7, 3, 64, 0.5)
    assert cfg.adam.weight_decay == AdamConfig().weight_decay  # deleted from the base: the schema default
    assert cfg.data.paths == ["c.txt"]


def test_overrides_dotted_keys(inherited: Path) -> None:
    overrides = {"model.checkpoint": 1.0, "cpu_offloading.enable": True, "cpu_offloading.num_layers": 1, "seed": 9}
    raw = load_config_file(inherited, overrides)
    assert raw["model"]["checkpoint"] == 1.0
    assert raw["model"]["hidden_size"] == 64  # the rest of the section survives the override
    assert raw["cpu_offloading"] == dict(enable=True, num_layers=1)
    cfg = resolve_config(raw)
    assert (cfg.seed, cfg.cpu_offloading.enable, cfg.cpu_offloading.num_layers) == (9, True, 1)


def test_overrides_parsed_like_the_command_line(inherited: Path) -> None:
    options = parse_cfg_options(
        "model.checkpoint=0.25", "cpu_offloading.enable=True", "adam.lr=3e-4", "data.paths=[x.txt,y.txt]", "seed=3"
    )
    cfg = resolve_config(load_config_file(inherited, options))
    assert cfg.model.checkpoint == 0.25
    assert cfg.cpu_offloading.enable is True
    assert cfg.adam.lr == 3e-4
    assert cfg.data.paths == ["x.txt", "y.txt"]
    assert cfg.seed == 3 and cfg.data.seed == 3


def test_override_typo_is_caught_after_merge(inherited: Path) -> None:
    raw = load_config_file(inherited, {"model.num_layrs": 2})  # mmengine creates the key silently...
    assert raw["model"]["num_layrs"] == 2
    message = config_error(raw)  # ...validation rejects it
    assert "'model.num_layrs'" in message and "did you mean 'model.num_layers'?" in message


def test_upper_case_constants_are_ignored(tmp_path: Path) -> None:
    path = write(
        tmp_path / "consts.py",
        """
        JOB_NAME = "consts"
        SEQ_LEN = 64
        NUM_LAYER = 6
        model = dict(num_layers=NUM_LAYER)
        data = dict(seq_len=SEQ_LEN)
        """,
    )
    raw = load_config_file(path)
    assert raw["SEQ_LEN"] == 64  # mmengine keeps them...
    cfg = resolve_config(raw)  # ...the schema drops them, but not JOB_NAME
    assert (cfg.JOB_NAME, cfg.model.num_layers, cfg.data.seq_len) == ("consts", 6, 64)
    assert "SEQ_LEN" not in cfg.model_dump()


def test_lower_case_helper_is_an_unknown_key() -> None:
    message = config_error({"seq_len": 64})
    assert "'seq_len'" in message and "allowed keys:" in message


# ---------------------------------------------------------------- derived values


def test_kv_heads_default_to_heads() -> None:
    assert resolve_config({}).model.num_kv_attention_heads == ModelConfig().num_attention_heads
    cfg = resolve_config({"model": dict(num_attention_heads=8, hidden_size=256)})
    assert cfg.model.num_kv_attention_heads == 8
    cfg = resolve_config({"model": dict(num_attention_heads=8, num_kv_attention_heads=2, hidden_size=256)})
    assert cfg.model.num_kv_attention_heads == 2


def test_schedule_length_and_data_seed_derived() -> None:
    cfg = resolve_config({"seed": 77, "data": dict(total_steps=37)})
    assert cfg.lr_scheduler.total_steps == 37
    assert cfg.data.seed == 77
    cfg = resolve_config({"seed": 77, "data": dict(total_steps=37, seed=5), "lr_scheduler": dict(total_steps=50)})
    assert (cfg.lr_scheduler.total_steps, cfg.data.seed) == (50, 5)  # explicit values are kept


@pytest.mark.parametrize("world_size, expected", [(1, 8), (2, 16), (4, 32)])
def test_global_bsz_derived(world_size: int, expected: int) -> None:
    raw = {"data": dict(micro_bsz=4, micro_num=2), "parallel": dict(mode="ddp")}
    cfg = resolve_config(raw, world_size=world_size)
    assert (cfg.data.global_bsz, cfg.data.micro_num) == (expected, 2)


@pytest.mark.parametrize("world_size, micro_num", [(1, 8), (2, 4), (4, 2)])
def test_micro_num_derived_from_global_bsz(world_size: int, micro_num: int) -> None:
    raw = {"data": dict(micro_bsz=2, micro_num=1, global_bsz=16), "parallel": dict(mode="fsdp2")}
    cfg = resolve_config(raw, world_size=world_size)
    assert (cfg.data.micro_num, cfg.data.global_bsz) == (micro_num, 16)
    assert cfg.data.micro_bsz * cfg.data.micro_num * world_size == 16


@pytest.mark.parametrize("value, expected", [(True, 1.0), (False, 0.0), (1, 1.0), (0.5, 0.5)])
def test_checkpoint_bool_and_numbers(value: Any, expected: float) -> None:
    cfg = resolve_config({"model": dict(checkpoint=value)})
    assert cfg.model.checkpoint == expected and isinstance(cfg.model.checkpoint, float)


def test_checkpointed_layers_is_internevo_floor() -> None:
    assert resolve_config({"model": dict(num_layers=5, checkpoint=0.5)}).checkpointed_layers() == 2
    assert resolve_config({"model": dict(num_layers=8, checkpoint=True)}).checkpointed_layers() == 8


def test_tuple_paths_become_a_list() -> None:
    assert resolve_config({"data": dict(type="text", paths=("a.txt",))}).data.paths == ["a.txt"]


def test_resolve_does_not_mutate_raw() -> None:
    raw = {"SEQ": 1, "data": dict(micro_bsz=2, global_bsz=8)}
    resolve_config(raw)
    assert raw == {"SEQ": 1, "data": dict(micro_bsz=2, global_bsz=8)}


# ---------------------------------------------------------------- error paths: one line, key and value

ERRORS = {
    "unknown key, close match": (
        {"model": dict(num_layrs=2)},
        1,
        ["unknown config key 'model.num_layrs'", "did you mean 'model.num_layers'?"],
    ),
    "unknown section, close match": (
        {"cpu_offload": dict(enable=True)},
        1,
        ["'cpu_offload'", "did you mean 'cpu_offloading'?"],
    ),
    "unknown key, no close match": (
        {"model": dict(zzzz=2)},
        1,
        [
            "unknown config key 'model.zzzz'",
            "allowed keys: attention_bias, attn_impl, balancing_loss, checkpoint, decoder_sparse_step,",
        ],
    ),
    "wrong type, int": ({"model": dict(num_layers="4")}, 1, ["model.num_layers='4'", "valid integer"]),
    "wrong type, float for int": ({"data": dict(seq_len=64.0)}, 1, ["data.seq_len=64.0", "valid integer"]),
    "wrong type, bool": ({"deterministic": "yes"}, 1, ["deterministic='yes'", "valid boolean"]),
    "wrong type, section": ({"model": 3}, 1, ["model=3", "valid dictionary"]),
    "wrong type, list": ({"data": dict(type="text", paths="a.txt")}, 1, ["data.paths='a.txt'", "valid list"]),
    "out of range, upper": ({"model": dict(checkpoint=1.5)}, 1, ["model.checkpoint=1.5", "less than or equal to 1"]),
    "out of range, lower": ({"data": dict(seq_len=1)}, 1, ["data.seq_len=1", "greater than or equal to 2"]),
    "out of range, exclusive": ({"adam": dict(lr=0.0)}, 1, ["adam.lr=0.0", "greater than 0"]),
    "profile step below 0": (
        {"monitor": dict(profile_step=-1)},
        1,
        ["monitor.profile_step=-1", "greater than or equal to 0"],
    ),
    "profile step after the last": (
        {"monitor": dict(profile_step=9), "data": dict(total_steps=8)},
        1,
        ["monitor.profile_step=9 is after the run's last step (data.total_steps=8)", "from 1 to 8, or 0 for none"],
    ),
    "empty string": ({"JOB_NAME": ""}, 1, ["JOB_NAME=''", "at least 1 character"]),
    "literal, dtype": (
        {"model": dict(dtype="torch.int8")},
        1,
        ["model.dtype='torch.int8'", "'torch.float32', 'torch.bfloat16' or 'torch.float16'"],
    ),
    "literal, parallel mode": ({"parallel": dict(mode="tp")}, 1, ["parallel.mode='tp'", "'none', 'ddp' or 'fsdp2'"]),
    "literal, device": ({"device": "tpu"}, 1, ["device='tpu'", "'auto', 'cpu', 'cuda' or 'npu'"]),
    "offload layers without enable": (
        {"cpu_offloading": dict(num_layers=1)},
        1,
        ["cpu_offloading.num_layers=1", "needs cpu_offloading.enable=True"],
    ),
    "offload every layer": (
        {"cpu_offloading": dict(enable=True, num_layers=4), "model": dict(num_layers=4)},
        1,
        ["cpu_offloading.num_layers=4", "must be < model.num_layers=4"],
    ),
    "selective offload without selective": (
        {"selective_checkpoint_offload": True},
        1,
        ["selective_checkpoint_offload=True", "needs selective_checkpoint=True"],
    ),
    "swap and hybrid optimizer": (
        {"swap_optimizer": True, "hybrid_optimizer": dict(enable=True)},
        1,
        ["swap_optimizer=True", "hybrid_optimizer.enable=True", "exclude each other"],
    ),
    "hidden not divisible by heads": (
        {"model": dict(hidden_size=130, num_attention_heads=4)},
        1,
        ["model.hidden_size=130", "model.num_attention_heads=4"],
    ),
    "heads not divisible by kv heads": (
        {"model": dict(num_attention_heads=4, num_kv_attention_heads=3)},
        1,
        ["model.num_attention_heads=4", "model.num_kv_attention_heads=3"],
    ),
    "text data without paths": ({"data": dict(type="text")}, 1, ["data.type='text'", "needs data.paths"]),
    "hf model with neither source": (
        {"model": dict(type="hf_causal_lm")},
        1,
        ["model.type='hf_causal_lm'", "exactly one of model.hf_path and model.hf_config"],
    ),
    "hf model with both sources": (
        {"model": dict(type="hf_causal_lm", hf_path="/m", hf_config={"model_type": "llama"})},
        1,
        ["model.type='hf_causal_lm'", "exactly one of model.hf_path and model.hf_config"],
    ),
    "global_bsz not divisible": (
        {"data": dict(micro_bsz=4, global_bsz=6)},
        1,
        ["data.global_bsz=6", "data.micro_bsz * data-parallel ranks = 4 * 1", "multiple of 4"],
    ),
    "global_bsz not divisible by world size": (
        {"data": dict(micro_bsz=2, global_bsz=6), "parallel": dict(mode="ddp")},
        2,
        ["data.global_bsz=6", "2 * 2", "multiple of 4"],
    ),
    "no parallel mode for two processes": ({}, 2, ["parallel.mode='none'", "world size 2", "'ddp' or 'fsdp2'"]),
    "preflight not a bool": ({"preflight": "yes"}, 1, ["preflight='yes'", "valid boolean"]),
    "auto knob without a budget": (
        {"cpu_offloading": dict(num_layers="auto")},
        1,
        ["cpu_offloading.num_layers='auto' needs memory_budget.device", "memory_budget=dict(device='40GiB')"],
    ),
    "budget not a size": (
        {"memory_budget": dict(device="lots")},
        1,
        ["memory_budget.device='lots'", "a positive size like '80GiB'"],
    ),
    "auto where no planner choice exists": ({"model": dict(num_layers="auto")}, 1, ["model.num_layers='auto'"]),
    "budget not a section": ({"memory_budget": 3}, 1, ["memory_budget=3", "valid dictionary"]),
}


def test_auto_knobs_hold_the_features_off_until_the_planner_chooses() -> None:
    cfg = resolve_config(
        {
            "memory_budget": dict(device="1.5GiB", host=2**30),
            "model": dict(checkpoint="auto"),
            "cpu_offloading": dict(enable="auto", num_layers="auto"),
            "swap_optimizer": "auto",
        }
    )
    assert cfg.auto_knobs == (
        "model.checkpoint",
        "cpu_offloading.enable",
        "cpu_offloading.num_layers",
        "swap_optimizer",
    )
    assert (cfg.model.checkpoint, cfg.cpu_offloading.enable, cfg.cpu_offloading.num_layers) == (0.0, False, 0)
    assert not cfg.swap_optimizer and cfg.memory_budget.device == 3 * 2**29 and cfg.memory_budget.host == 2**30
    assert resolve_config({}).auto_knobs == ()
    with pytest.raises(ConfigError, match=r"swap_optimizer='auto' needs memory_budget.device(.|\n)*memory_budget=3"):
        resolve_config({"memory_budget": 3, "swap_optimizer": "auto"})  # both problems, in one report


@pytest.mark.parametrize("raw, world_size, parts", list(ERRORS.values()), ids=list(ERRORS))
def test_error_is_one_line_naming_key_and_value(raw: dict[str, Any], world_size: int, parts: list[str]) -> None:
    message = config_error(raw, world_size)
    for part in parts:
        assert part in message


@pytest.mark.parametrize("section, fields", [("", RunConfig.model_fields), ("model.", ModelConfig.model_fields)])
def test_unknown_key_lists_every_allowed_key(section: str, fields: dict[str, Any]) -> None:
    raw: dict[str, Any] = {"qqqqqq": 1}
    if section:
        raw = {section.rstrip("."): raw}
    message = config_error(raw)
    listed = message.split("allowed keys: ", 1)[1].split(", ")
    assert listed == sorted(fields)


# ---------------------------------------------------------------- file errors


def _missing(tmp_path: Path) -> Path:
    return tmp_path / "nope.py"


def _not_python(tmp_path: Path) -> Path:
    return write(tmp_path / "cfg.json", "{}")


def _syntax_error(tmp_path: Path) -> Path:
    return write(tmp_path / "syntax.py", "seed = 1\nmodel = dict(num_layers=2\n")


def _import_line(tmp_path: Path) -> Path:
    return write(tmp_path / "imports.py", "seed = 1\nimport torch\nmodel = dict(dtype=torch.float32)\n")


def _from_import(tmp_path: Path) -> Path:
    return write(tmp_path / "from_import.py", "seed = 1\nseed2 = 2\nfrom os import path\n")


def _missing_base(tmp_path: Path) -> Path:
    return write(tmp_path / "child.py", '_base_ = ["./no_base.py"]\n')


def _syntax_error_in_base(tmp_path: Path) -> Path:
    write(tmp_path / "broken_base.py", "model = dict(\n")
    return write(tmp_path / "child.py", '_base_ = ["./broken_base.py"]\n')


FILE_ERRORS = {
    "missing file": (_missing, ["--config", "file not found", "nope.py"]),
    "not a .py file": (_not_python, ["--config", "cfg.json", "not a Python config file (.py)"]),
    "syntax error": (_syntax_error, ["--config", "syntax.py", "syntax error at line 2"]),
    "import line": (_import_line, ["imports.py", "line 2", "import statements are not allowed"]),
    "from import": (_from_import, ["from_import.py", "line 3", "import statements are not allowed"]),
    "missing base": (_missing_base, ["child.py", "_base_ file not found", "no_base.py"]),
    "syntax error in base": (_syntax_error_in_base, ["broken_base.py", "was never closed", "line 1"]),
}


@pytest.mark.parametrize("make, parts", list(FILE_ERRORS.values()), ids=list(FILE_ERRORS))
def test_file_error_is_one_line(tmp_path: Path, make: Any, parts: list[str]) -> None:
    path = make(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config_file(path)
    message = str(info.value)
    assert "\n" not in message
    for part in parts:
        assert part in message


# ---------------------------------------------------------------- reserved offload keys

VALID_OFFLOAD = {
    "cpu_offloading, every field": {
        "cpu_offloading": dict(
            enable=True, num_layers=3, mode="sync", min_offload_bytes=0, prefetch_layers=2, pin_memory=False
        )
    },
    "selective checkpoint with offload": {"selective_checkpoint": True, "selective_checkpoint_offload": True},
    "swap optimizer": {"swap_optimizer": True, "swap_optimizer_times": 4, "use_pinned_optimizer_offload": True},
    "hybrid optimizer, every field": {
        "hybrid_optimizer": dict(
            enable=True, offload_fraction=0.25, overlap_cpu_optimizer_d2h_h2d=False, param_update_in_fp32=True
        )
    },
    "hybrid optimizer, bounds": {"hybrid_optimizer": dict(enable=True, offload_fraction=1)},
    "offload, all off": {
        "cpu_offloading": dict(enable=False, num_layers=0),
        "selective_checkpoint": False,
        "selective_checkpoint_offload": False,
        "swap_optimizer": False,
        "use_pinned_optimizer_offload": False,
        "hybrid_optimizer": dict(enable=False, offload_fraction=0.0),
    },
}


@pytest.mark.parametrize("raw", list(VALID_OFFLOAD.values()), ids=list(VALID_OFFLOAD))
def test_reserved_offload_keys_accepted(raw: dict[str, Any]) -> None:
    resolved = resolve_config(raw).model_dump()
    for key, value in raw.items():
        if isinstance(value, dict):
            assert {k: resolved[key][k] for k in value} == value
        else:
            assert resolved[key] == value


INVALID_OFFLOAD = {
    "cpu_offloading.enable not bool": ({"cpu_offloading": dict(enable="yes")}, "cpu_offloading.enable='yes'"),
    "cpu_offloading.num_layers negative": (
        {"cpu_offloading": dict(enable=True, num_layers=-1)},
        "cpu_offloading.num_layers=-1",
    ),
    "cpu_offloading.mode": ({"cpu_offloading": dict(mode="fast")}, "cpu_offloading.mode='fast'"),
    "cpu_offloading.min_offload_bytes": (
        {"cpu_offloading": dict(min_offload_bytes=-1)},
        "cpu_offloading.min_offload_bytes=-1",
    ),
    "cpu_offloading.prefetch_layers": ({"cpu_offloading": dict(prefetch_layers=0)}, "cpu_offloading.prefetch_layers=0"),
    "cpu_offloading typo": ({"cpu_offloading": dict(enabled=True)}, "did you mean 'cpu_offloading.enable'?"),
    "cpu_offloading not a dict": ({"cpu_offloading": True}, "cpu_offloading=True"),
    "selective_checkpoint int": ({"selective_checkpoint": 1}, "selective_checkpoint=1"),
    "selective_checkpoint_offload str": (
        {"selective_checkpoint_offload": "True"},
        "selective_checkpoint_offload='True'",
    ),
    "swap_optimizer str": ({"swap_optimizer": "true"}, "swap_optimizer='true'"),
    "swap_optimizer_times zero": ({"swap_optimizer_times": 0}, "swap_optimizer_times=0"),
    "swap_optimizer_times float": ({"swap_optimizer_times": 2.5}, "swap_optimizer_times=2.5"),
    "use_pinned_optimizer_offload": ({"use_pinned_optimizer_offload": None}, "use_pinned_optimizer_offload=None"),
    "hybrid_optimizer.offload_fraction high": (
        {"hybrid_optimizer": dict(offload_fraction=1.5)},
        "hybrid_optimizer.offload_fraction=1.5",
    ),
    "hybrid_optimizer.offload_fraction negative": (
        {"hybrid_optimizer": dict(offload_fraction=-0.1)},
        "hybrid_optimizer.offload_fraction=-0.1",
    ),
    "hybrid_optimizer.enable": ({"hybrid_optimizer": dict(enable="on")}, "hybrid_optimizer.enable='on'"),
    "hybrid_optimizer typo": ({"hybrid_optimizer": dict(fraction=0.5)}, "'hybrid_optimizer.fraction'"),
}


@pytest.mark.parametrize("raw, part", list(INVALID_OFFLOAD.values()), ids=list(INVALID_OFFLOAD))
def test_reserved_offload_keys_rejected(raw: dict[str, Any], part: str) -> None:
    assert part in config_error(raw)


def test_reserved_offload_key_sets_are_complete() -> None:
    reserved = {"cpu_offloading", "selective_checkpoint", "selective_checkpoint_offload", "swap_optimizer"}
    reserved |= {"swap_optimizer_times", "use_pinned_optimizer_offload", "hybrid_optimizer"}
    assert reserved <= set(RunConfig.model_fields)
    assert set(CpuOffloadingConfig.model_fields) >= {"enable", "num_layers"}
    assert set(HybridOptimizerConfig.model_fields) >= {"enable", "offload_fraction"}


# ---------------------------------------------------------------- fingerprint


def test_fingerprint_is_stable() -> None:
    raw = {"seed": 3, "model": dict(num_layers=2, checkpoint=0.5), "data": dict(seq_len=64)}
    reordered = {"data": dict(seq_len=64), "model": dict(checkpoint=0.5, num_layers=2), "seed": 3}
    fingerprint = resolve_config(raw).fingerprint()
    assert re.fullmatch(r"[0-9a-f]{12}", fingerprint)
    assert resolve_config(raw).fingerprint() == fingerprint
    assert resolve_config(reordered).fingerprint() == fingerprint


def test_fingerprint_is_stable_across_processes() -> None:
    code = "from internlm_offload.config import resolve_config; print(resolve_config({'seed': 3}).fingerprint())"
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == resolve_config({"seed": 3}).fingerprint()


@pytest.mark.parametrize(
    "change",
    [
        {"seed": 4},
        {"adam": dict(lr=2e-3)},
        {"model": dict(checkpoint=1.0)},
        {"cpu_offloading": dict(enable=True, num_layers=1)},
        {"hybrid_optimizer": dict(offload_fraction=0.75)},
    ],
)
def test_fingerprint_changes_with_a_value(change: dict[str, Any]) -> None:
    assert resolve_config(change).fingerprint() != resolve_config({}).fingerprint()


def test_fingerprint_covers_derived_values() -> None:
    raw = {"parallel": dict(mode="ddp"), "data": dict(micro_bsz=2)}
    assert resolve_config(raw, world_size=1).fingerprint() != resolve_config(raw, world_size=2).fingerprint()


# ---------------------------------------------------------------- shipped configs


def test_shipped_configs_exist() -> None:
    assert SHIPPED_CONFIGS, "no configs/*.py found"


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=[p.name for p in SHIPPED_CONFIGS])
def test_shipped_config_loads_and_resolves(path: Path) -> None:
    raw = load_config_file(path)
    parallel = raw.get("parallel", {})
    # a pipeline's config needs its stages' ranks, an expert-parallel one (the planner's) its expert group's
    world_size = parallel.get("pipeline", {}).get("size", 1) * parallel.get("expert", {}).get("size", 1)
    cfg = resolve_config(raw, world_size=world_size)
    assert cfg.JOB_NAME
    assert cfg.lr_scheduler.total_steps is not None and cfg.data.seed is not None and cfg.data.global_bsz is not None
    plan = make_layer_plan(
        cfg.model.num_layers,
        offload_layers=cfg.cpu_offloading.num_layers,
        checkpoint_ratio=cfg.model.checkpoint,
        selective=cfg.selective_checkpoint,
        selective_offload=cfg.selective_checkpoint_offload,
    )
    assert len(plan.modes) == cfg.model.num_layers


def test_tiny_config_values() -> None:
    cfg = resolve_config(load_config_file(REPO / "configs" / "internlm2_tiny.py"))
    assert cfg.JOB_NAME == "internlm2_tiny"
    assert (cfg.model.num_layers, cfg.model.num_attention_heads, cfg.model.num_kv_attention_heads) == (4, 4, 2)
    assert (cfg.data.micro_bsz, cfg.data.micro_num, cfg.data.global_bsz) == (4, 2, 8)
    assert (cfg.data.total_steps, cfg.lr_scheduler.total_steps) == (120, 120)
    assert (cfg.seed, cfg.data.seed) == (1024, 1024)
    assert cfg.adam.lr == 3e-3 and cfg.lr_scheduler.eta_min == 3e-4


# ---------------------------------------------------------------- regressions found in review


def test_override_into_a_scalar_is_a_config_error(inherited: Path) -> None:
    with pytest.raises(ConfigError, match="seed"):  # e.g. a user who takes a flag for a section
        load_config_file(inherited, parse_cfg_options("seed.enable=True"))


def test_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.py"
    path.write_bytes(b'JOB_NAME = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="latin1.py"):
        load_config_file(path)


def test_import_in_a_base_is_rejected_up_front(tmp_path: Path) -> None:
    write(tmp_path / "base.py", "import math\nmodel = dict(num_layers=2)\n")
    child = write(tmp_path / "child.py", '_base_ = ["./base.py"]\n')
    with pytest.raises(ConfigError, match=r"base\.py line 1: import statements are not allowed"):
        load_config_file(child)


def test_every_problem_of_a_config_in_one_report() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config({"model": dict(num_layers=0, hidden_size=0), "parallel": dict(sequence_2D=dict(enable=True))})
    lines = str(info.value).splitlines()
    assert lines[0] == "3 problems in the config:"
    assert any("parallel.sequence_2D.enable=True" in line for line in lines)
    assert any("model.num_layers=0" in line for line in lines) and any("model.hidden_size=0" in line for line in lines)


@pytest.mark.parametrize(
    "raw, fragments",
    [
        ({"grad_offload": True}, ["grad_offload=True needs", "swap_optimizer=True", "offload_fraction=1.0"]),
        (
            {"grad_offload": True, "hybrid_optimizer": {"enable": True, "offload_fraction": 0.5}},
            ["grad_offload=True needs", "offload_fraction=0.5"],
        ),
        (
            {"grad_offload": True, "swap_optimizer": True, "parallel": {"mode": "fsdp2", "fsdp_cpu_offload": True}},
            ["fsdp_cpu_offload=True", "excludes swap_optimizer"],
        ),
        ({"grad_offload": True, "swap_optimizer": True, "grad_offload_bucket_mb": 0}, ["grad_offload_bucket_mb"]),
    ],
)
def test_gradient_offload_needs_an_optimizer_stepping_from_host_gradients(raw, fragments):
    message = config_error(raw)
    for fragment in fragments:
        assert fragment in message, message
    assert resolve_config({"grad_offload": True, "swap_optimizer": True}).grad_offload


@pytest.mark.parametrize(
    "item, part",
    [
        ("data.seq_len=[1,2", "cannot parse the value (Imbalanced brackets exist in [1,2)"),
        ("model.checkpoint=[0.5]]", "balanced brackets"),
        ("swap_optimizer", "expected key=value"),
    ],
)
def test_an_unparsable_cfg_option_is_one_line_exit_2(item: str, part: str, capsys: Any) -> None:
    """mmengine's DictAction asserts on these; the command names the item in one line instead of a traceback."""
    from internlm_offload import launch

    argv = ["--config", str(REPO / "configs/internlm2_tiny.py"), "--cfg-options", "data.seq_len=64", item]
    assert launch.main(argv, build_trainer=None) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --cfg-options {item}: ") and part in err and "\n" not in err, err


def test_an_nvme_path_without_enable_is_said() -> None:
    """DeepSpeed's users write only the path: the states would silently stay in host memory, so it is a warning
    in the start-up log; with enable=True, or without a path, there is none."""
    warnings = resolve_config({"swap_optimizer": True, "nvme_offload": {"path": "/tmp"}}).migration_notes()[1]
    assert any("nvme_offload.path='/tmp' is set but nvme_offload.enable=False" in line for line in warnings)
    enabled = resolve_config({"swap_optimizer": True, "nvme_offload": {"path": "/tmp", "enable": True}})
    assert not any("nvme_offload" in line for line in enabled.migration_notes()[1])
    assert not any("nvme_offload" in line for line in resolve_config({}).migration_notes()[1])


def test_a_delete_marker_without_a_base_section_is_dropped(tmp_path: Path) -> None:
    """`_delete_=True` for a section the bases do not set (configs/_base_/runtime.py leaves `parallel` out) replaces
    nothing: the section loads as written, without the marker (mmengine keeps it there)."""
    config = write(
        tmp_path / "run.py",
        f'_base_ = ["{REPO}/configs/internlm2_tiny.py"]\nparallel = dict(_delete_=True, mode="ddp")\n'
        "model = dict(_delete_=True, num_layers=2)\n",
    )
    raw = load_config_file(config)
    assert raw["parallel"] == {"mode": "ddp"} and raw["model"] == {"num_layers": 2}
    assert resolve_config(raw).parallel.mode == "ddp"
