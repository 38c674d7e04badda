"""Checkpoints are data: the safe DCP reader loads what DCP wrote and refuses a checkpoint that would run code."""

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from internlm_offload.engine.checkpoint_reader import UnsafeCheckpointError, read_checkpoint, read_metadata


class _TouchFile:
    """Unpickles into `os.system("touch <path>")`: what a malicious checkpoint would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def _trained_state(dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(4, 8, dtype=dtype)).float().sum().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "extra": {"step": 3, "name": "x", "pair": (1.0, None)}}


def _blank(state: dict) -> dict:
    """The same structure with every tensor zeroed and every plain value replaced."""
    if isinstance(state, dict):
        return {key: _blank(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_blank(value) for value in state]
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else None


def _assert_same(got, want) -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            _assert_same(got[key], want[key])
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    else:
        assert got == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reads_what_dcp_wrote_bitwise(tmp_path: Path, dtype: torch.dtype) -> None:
    state = _trained_state(dtype)
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    loaded = _blank(state)
    read_checkpoint(tmp_path, loaded, no_dist=True)
    _assert_same(loaded, state)
    assert set(read_metadata(tmp_path).state_dict_metadata) == set(
        dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    )


def test_metadata_that_would_run_code_is_refused_before_it_runs(tmp_path: Path) -> None:
    checkpoint, marker = tmp_path / "ckpt", tmp_path / "PWNED"
    dcp.save(_trained_state(torch.float32), checkpoint_id=str(checkpoint), no_dist=True)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_TouchFile(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata would load posix\.system"):
        read_metadata(checkpoint)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata would load posix\.system"):
        read_checkpoint(checkpoint, _blank(_trained_state(torch.float32)), no_dist=True)
    assert not marker.exists()
    # The hole this closes: DCP's own reader runs the payload.
    with pytest.raises(Exception):
        dcp.FileSystemReader(str(checkpoint)).read_metadata()
    assert marker.exists()


def test_entry_that_would_run_code_is_refused_before_it_runs(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    state = {"model": {"w": torch.ones(3)}, "extra": {"payload": _TouchFile(marker)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert not marker.exists()
    target = {"model": {"w": torch.zeros(3)}, "extra": {"payload": None}}
    with pytest.raises(UnsafeCheckpointError, match=r"entry 'extra\.payload' would load posix\.system"):
        read_checkpoint(tmp_path / "ckpt", target, no_dist=True)
    assert not marker.exists()
    # The hole this closes: DCP's default planner loads entries with weights_only=False.
    shutil.copytree(tmp_path / "ckpt", tmp_path / "copy")
    dcp.load(
        {"model": {"w": torch.zeros(3)}, "extra": {"payload": None}}, checkpoint_id=str(tmp_path / "copy"), no_dist=True
    )
    assert marker.exists()
