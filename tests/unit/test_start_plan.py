"""`plan_start`: what a run starts from, and the refusals before anything is built, in their order."""

import json
from pathlib import Path

import pytest
import torch

from internlm_offload.config import resolve_config
from internlm_offload.engine.checkpoint import FORMAT_VERSION, MANIFEST, TRAIN_STATE, CheckpointError
from internlm_offload.engine.start_plan import StartPlan, plan_start
from internlm_offload.engine.checkpoint_integrity import checkpoint_files, record_files
from internlm_offload.weights.sources import WeightsSource


def fake_checkpoint(folder: Path, step: int, dtype: str = "torch.float32") -> Path:
    """A complete checkpoint as far as start-up looks: a manifest and a train state with the config."""
    path = folder / f"step_{step:08d}"
    path.mkdir(parents=True)
    torch.save({"config": {"model": {"dtype": dtype}, "mixed_precision": {"master_weights": True}}}, path / TRAIN_STATE)
    files = record_files(path, checkpoint_files(path))
    (path / MANIFEST).write_text(json.dumps({"format": FORMAT_VERSION, "step": step, "model": {}, "files": files}))
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
    assert plan_start(cfg, tmp_path, resume=False) == StartPlan(
        tmp_path / "checkpoints", weights_from=WeightsSource(source, "dcp")
    )


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


def test_a_resume_passes_damaged_checkpoints_and_says_so(tmp_path, caplog):
    intact = fake_checkpoint(tmp_path / "checkpoints", 4)
    truncated = fake_checkpoint(tmp_path / "checkpoints", 6)
    (truncated / TRAIN_STATE).write_bytes((truncated / TRAIN_STATE).read_bytes()[:10])
    plan = plan_start(resolve_config({}), tmp_path, resume=True)
    assert plan.resume_from == intact
    warning = [r.getMessage() for r in caplog.records if "newest intact" in r.getMessage()]
    expected = (
        f"Resume: step_00000006 is damaged ({TRAIN_STATE} has 10 B, the manifest says "
        f"{(intact / TRAIN_STATE).stat().st_size / 1024:.1f} KiB); resuming from step_00000004, the newest intact "
        "checkpoint (nothing was deleted)"
    )
    assert warning == [expected]
    assert truncated.is_dir()  # kept


def test_a_resume_with_only_damaged_checkpoints_is_refused(tmp_path):
    only = fake_checkpoint(tmp_path / "checkpoints", 2)
    (only / TRAIN_STATE).unlink()
    with pytest.raises(
        CheckpointError, match=f"no intact checkpoint in .*: step_00000002 is damaged \\({TRAIN_STATE} is missing\\)"
    ):
        plan_start(resolve_config({}), tmp_path, resume=True)


def test_a_damaged_checkpoint_named_by_the_config_is_refused(tmp_path):
    source = fake_checkpoint(tmp_path / "other", 5)
    manifest = json.loads((source / MANIFEST).read_text())
    manifest["files"][TRAIN_STATE]["sha256"] = "0" * 64  # a manifest that lies
    (source / MANIFEST).write_text(json.dumps(manifest))
    for content in (("model",), ("all",)):
        cfg = resolve_config({"ckpt": {"load_ckpt_info": {"path": str(source), "content": content}}})
        with pytest.raises(CheckpointError, match=f"{source} is damaged: {TRAIN_STATE} does not match its SHA-256"):
            plan_start(cfg, tmp_path, resume=False)
