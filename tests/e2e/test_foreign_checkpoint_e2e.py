"""A checkpoint from elsewhere cannot run code: each read path refuses a crafted one in one line, exit 2."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from runner import TINY, run_python, train
from test_bad_input import assert_clean_error

from internlm_offload.engine.checkpoint_integrity import record_files


class _TouchFile:
    """Unpickles into `os.system("touch <path>")`: what a malicious checkpoint would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A run whose only checkpoint's `.metadata` would create a file when unpickled; and that file."""
    run = tmp_path_factory.mktemp("foreign") / "run"
    train(run, "data.total_steps=2", "ckpt.checkpoint_every=2")
    checkpoint = run / "checkpoints" / "step_00000002"
    marker = run.parent / "PWNED"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_TouchFile(marker)))
    # Whoever crafts a checkpoint writes its manifest too: the file list vouches for the crafted bytes.
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][".metadata"] = record_files(checkpoint, [".metadata"])[".metadata"]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    return run, marker


def _refused(proc: subprocess.CompletedProcess, marker: Path) -> None:
    assert_clean_error(proc, ".metadata would load posix.system", "refusing to read it")
    assert not marker.exists()


def test_resume_refuses_a_crafted_checkpoint(crafted: tuple[Path, Path]) -> None:
    run, marker = crafted
    _refused(train(run, "data.total_steps=4", resume=True, check=False), marker)


def test_model_only_load_refuses_a_crafted_checkpoint(crafted: tuple[Path, Path], tmp_path: Path) -> None:
    run, marker = crafted
    config = tmp_path / "finetune.py"
    config.write_text(
        f"_base_ = [{str(TINY)!r}]\n"
        f"ckpt = dict(load_ckpt_info=dict(path={str(run / 'checkpoints')!r}, content=('model',)))\n"
    )
    _refused(train(tmp_path / "tuned", "data.total_steps=2", config=config, check=False), marker)


def test_export_refuses_a_crafted_checkpoint(crafted: tuple[Path, Path], tmp_path: Path) -> None:
    run, marker = crafted
    command = [
        sys.executable,
        "-m",
        "internlm_offload.tools.export",
        str(run / "checkpoints"),
        str(tmp_path / "w.safetensors"),
    ]
    _refused(run_python(command, timeout=300), marker)
