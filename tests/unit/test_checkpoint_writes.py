"""Checkpoint writes that fail, and the files a manifest vouches for: one process, the real DCP writer."""

import errno
import json
import re

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from internlm_offload.device import Accelerator
from internlm_offload.engine import checkpoint as ckpt
from internlm_offload.engine.checkpoint import MANIFEST, CheckpointManager, CheckpointWriteError
from internlm_offload.engine.checkpoint_integrity import sha256_of
from internlm_offload.engine.runtime import RunContext


def manager(folder) -> CheckpointManager:
    return CheckpointManager(folder, RunContext(rank=0, local_rank=0, world_size=1, accelerator=Accelerator("cpu")))


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 16)).sum().backward()
    optimizer.step()
    return model, optimizer


def save(checkpoints: CheckpointManager, step: int):
    model, optimizer = model_and_optimizer()
    return checkpoints.save(step, model=model, optimizer=optimizer, train_state={"step": step})


def snapshot(folder) -> dict:
    """Every path under `folder` (folders too) with its bytes."""
    return {p: p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


def test_the_manifest_lists_every_file_with_its_size_and_sha256(tmp_path):
    path = save(manager(tmp_path), 2)
    files = json.loads((path / MANIFEST).read_text())["files"]
    on_disk = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert sorted(files) == on_disk and ".metadata" in files and "rng/rank_0.pt" in files
    for name, record in files.items():
        assert record == {"size": (path / name).stat().st_size, "sha256": sha256_of(path / name)}
    assert ckpt.checkpoint_problems(path) == []


def test_the_manifest_records_the_layout_and_a_move_is_described_by_both(tmp_path):
    """The manifest holds the saving run's parallel dims; a load on another layout names both, an old manifest
    (world size only) matches any layout of its world size."""
    from internlm_offload.engine.checkpoint_layout import describe_layout, describe_move, same_layout, saved_layout

    manifest = json.loads((save(manager(tmp_path), 2) / MANIFEST).read_text())
    one = {"world_size": 1, "pipeline": 1, "tensor": 1, "data": 1, "expert": 1}
    assert saved_layout(manifest) == one and describe_layout(one) == "1 rank"
    pipeline = {"world_size": 4, "pipeline": 2, "tensor": 1, "data": 2, "expert": 1}
    experts = {"world_size": 4, "pipeline": 1, "tensor": 1, "data": 4, "expert": 4}
    assert describe_move(pipeline, experts) == (
        "saved on 4 ranks (pipeline 2, data 2), loading on 4 ranks (data 4, expert 4)"
    )
    assert not same_layout(pipeline, experts) and same_layout(experts, dict(experts))
    old = saved_layout({"world_size": 4})
    assert same_layout(old, experts) and not same_layout(old, one) and describe_layout(old) == "4 ranks"


def _fail_writes(monkeypatch, error: OSError) -> None:
    def write_data(self, plan, planner):
        raise error

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)


@pytest.mark.parametrize(
    "error, cause",
    [
        (
            OSError(errno.ENOSPC, "No space left on device"),
            "no space left on device: .* free, the checkpoint needs about",
        ),
        (PermissionError(errno.EACCES, "Permission denied", "/ckpt/x"), "permission denied: /ckpt/x"),
    ],
    ids=["no_space", "permission"],
)
def test_a_failed_write_names_the_cause_and_the_last_good_checkpoint_and_leaves_nothing(
    tmp_path, monkeypatch, error, cause
):
    checkpoints = manager(tmp_path)
    good = save(checkpoints, 2)
    before = snapshot(tmp_path)
    _fail_writes(monkeypatch, error)
    with pytest.raises(CheckpointWriteError) as caught:
        save(checkpoints, 4)
    assert f"checkpoint {tmp_path / 'step_00000004'} could not be written: " in str(
        caught.value
    ) and f"the last good checkpoint, {good}, is intact and the partial folder was removed" in str(caught.value)
    assert re.search(cause, str(caught.value)), str(caught.value)
    assert snapshot(tmp_path) == before  # no partial folder, `latest` and step 2 as they were


def test_a_file_system_too_small_refuses_before_writing(tmp_path, monkeypatch):
    checkpoints = manager(tmp_path)
    monkeypatch.setattr(ckpt, "free_bytes", lambda folder: 1000)
    with pytest.raises(CheckpointWriteError, match="not enough space: 1000 B free, a checkpoint needs about"):
        save(checkpoints, 2)
    assert list(tmp_path.iterdir()) == []
    model, _ = model_and_optimizer()
    with pytest.raises(CheckpointWriteError, match=f"cannot save checkpoints in {tmp_path}: not enough space: 1000 B"):
        checkpoints.check_space(checkpoints.expected_bytes(model))
    assert checkpoints.expected_bytes(model) == 3 * (16 * 8 + 8) * 4  # weights and AdamW's two moments, fp32


def test_a_damaged_step_written_again_moves_aside_and_is_kept(tmp_path):
    checkpoints = manager(tmp_path)
    damaged = save(checkpoints, 2)
    (damaged / "rng" / "rank_0.pt").write_bytes(b"x")
    again = save(checkpoints, 2)
    assert ckpt.checkpoint_problems(again) == []
    aside = tmp_path / ckpt.DAMAGED / "step_00000002"
    assert (aside / "rng" / "rank_0.pt").read_bytes() == b"x"
    assert ckpt.complete_checkpoints(tmp_path) == [again]


def test_an_intact_existing_step_is_not_overwritten(tmp_path):
    checkpoints = manager(tmp_path)
    first = save(checkpoints, 2)
    stamp = (first / MANIFEST).stat().st_mtime_ns
    assert save(checkpoints, 2) == first and (first / MANIFEST).stat().st_mtime_ns == stamp
    assert not (tmp_path / ckpt.DAMAGED).exists()


def test_verify_ckpt_lists_each_checkpoint_and_exits_1_when_one_is_damaged(tmp_path, capsys):
    from internlm_offload.tools import verify_ckpt

    checkpoints = manager(tmp_path)
    save(checkpoints, 2)
    checkpoints.keep_last = 0
    damaged = save(checkpoints, 4)
    assert verify_ckpt.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == ["step_00000002  intact", "step_00000004  intact"]
    (damaged / ".metadata").unlink()
    assert verify_ckpt.main([str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "step_00000002  intact",
        "step_00000004  damaged: .metadata is missing",
    ]
    assert verify_ckpt.main([str(tmp_path / "step_00000002")]) == 0
    assert verify_ckpt.main([str(tmp_path / "nowhere")]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err


def test_saved_optimizer_groups_are_regrouped_by_parameter_name(tmp_path):
    """A checkpoint moving between layouts meets other optimizer groups: each group here takes the hyperparameters
    its parameters were saved with; a group mixing parameters saved with different ones, or naming one the
    checkpoint lacks, is refused in one line."""
    from internlm_offload.engine.checkpoint import regroup_param_groups
    from internlm_offload.engine.checkpoint_layout import describe_move
    from internlm_offload.errors import CheckpointError

    saved = [
        {"lr": 1e-3, "weight_decay": 0.1, "params": ["a.weight", "experts.w1"]},
        {"lr": 1e-3, "weight_decay": 0.0, "params": ["a.bias"]},
    ]
    own = [
        {"lr": 5.0, "weight_decay": 9.0, "params": ["a.weight"]},
        {"lr": 5.0, "weight_decay": 9.0, "params": ["experts.w1"]},
        {"lr": 5.0, "weight_decay": 9.0, "params": ["a.bias"]},
    ]
    assert regroup_param_groups(saved, own, tmp_path) == [
        {"lr": 1e-3, "weight_decay": 0.1, "params": ["a.weight"]},
        {"lr": 1e-3, "weight_decay": 0.1, "params": ["experts.w1"]},
        {"lr": 1e-3, "weight_decay": 0.0, "params": ["a.bias"]},
    ]
    assert regroup_param_groups(saved, saved, tmp_path) == saved  # the saving layout: unchanged
    mixed = [{"lr": 0, "weight_decay": 0, "params": ["a.weight", "a.bias"]}]
    with pytest.raises(CheckpointError, match="saved with different hyperparameters"):
        regroup_param_groups(saved, mixed, tmp_path)
    move = describe_move({"world_size": 2, "data": 2, "expert": 2}, {"world_size": 1})
    with pytest.raises(CheckpointError) as refused:  # the refusal names both layouts, in one line
        regroup_param_groups(saved, mixed, tmp_path, move=move)
    assert "(saved on 2 ranks (data 2, expert 2), loading on 1 rank): the parameters of one" in str(refused.value)
    assert "\n" not in str(refused.value)
    with pytest.raises(CheckpointError, match="no optimizer hyperparameters saved for b.weight"):
        regroup_param_groups(saved, [{"lr": 0, "weight_decay": 0, "params": ["b.weight"]}], tmp_path)
