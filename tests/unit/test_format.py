"""The formatter owns layout: the tree is as `ruff format` (configured in pyproject.toml) leaves it."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_tree_is_formatted() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is a test dependency (pip install -e '.[test]')"
    proc = subprocess.run(
        [ruff, "format", "--check", "--output-format", "concise", str(REPO)], capture_output=True, text=True
    )
    assert proc.returncode == 0, f"run `ruff format` on:\n{proc.stdout}{proc.stderr}"
