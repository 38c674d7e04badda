"""`plan_start`: what a run starts from, and the refusals before anything is built, in their order."""

from pathlib import Path

import pytest
import torch

from internlm_offload.config import resolve_config
from internlm_offload.engine.checkpoint import MANIFEST, TRAIN_STATE, CheckpointError, StartPlan, plan_start


def fake_checkpoint(folder: Path, step: int, dtype: str = "torch.float32") -> Path:
    """A complete checkpoint as far as start-up looks: a manifest and a train state with the config."""
    path = folder / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / MANIFEST).write_text("{}")
    torch.save({"config": {"model": {"dtype": dtype}, "mixed_precision": {"master_weights": True}}}, path / TRAIN_STATE)
    return path


def test_a_fresh_run_loads_nothing(tmp_path):
    plan = plan_start(resolve_config({}), tmp_path, resume=False)
    assert plan == StartPlan(tmp_path / "checkpoints") and plan.fresh


def test_resume_takes_the_latest_of_this_run_and_honours_save_ckpt_folder(tmp_path):
    fake_checkpoint(tmp_path / "ckpt", 1)
    latest = fake_checkpoint(tmp_path / "ckpt", 2)
    cfg = resolve_config({"ckpt": {"save_ckpt_folder": str(tmp_path / "ckpt")}})
    plan = plan_start(cfg, tmp_path / "work", resume=True)
    assert plan == StartPlan(tmp_path / "ckpt", resume_from=latest) and not plan.fresh
    auto = resolve_config({"ckpt": {"save_ckpt_folder": str(tmp_path / "ckpt"), "auto_resume": True}})
    assert plan_start(auto, tmp_path / "work", resume=False).resume_from == latest


def test_resume_without_checkpoints_starts_from_scratch(tmp_path):
    assert plan_start(resolve_config({}), tmp_path, resume=True) == StartPlan(tmp_path / "checkpoints")


def test_weights_only_start_loads_the_weights_at_step_1(tmp_path):
    source = fake_checkpoint(tmp_path / "other", 5, dtype="torch.bfloat16")  # any dtype: weights are cast
    cfg = resolve_config({"ckpt": {"load_ckpt_info": {"path": str(tmp_path / "other"), "content": ("model",)}}})
    assert plan_start(cfg, tmp_path, resume=False) == StartPlan(tmp_path / "checkpoints", weights_from=source)


def test_a_fresh_run_over_earlier_checkpoints_is_refused(tmp_path):
    fake_checkpoint(tmp_path / "checkpoints", 3)
    with pytest.raises(CheckpointError, match="already holds checkpoints \\(latest: step_00000003\\); pass --resume"):
        plan_start(resolve_config({}), tmp_path, resume=False)


def test_a_resume_with_another_dtype_is_refused(tmp_path):
    fake_checkpoint(tmp_path / "checkpoints", 3, dtype="torch.bfloat16")
    with pytest.raises(CheckpointError, match="was written with model.dtype=torch.bfloat16"):
        plan_start(resolve_config({}), tmp_path, resume=True)


def test_a_missing_checkpoint_is_named_before_the_clobber_check(tmp_path):
    fake_checkpoint(tmp_path / "checkpoints", 3)
    cfg = resolve_config({"ckpt": {"load_ckpt_info": {"path": str(tmp_path / "nowhere")}}})
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        plan_start(cfg, tmp_path, resume=False)
