"""No import runs back up, and no package's modules import each other in a circle.

The layer order is written once, as import-linter contracts in pyproject.toml's `[tool.importlinter]`
(docs/architecture.md explains each floor); this test runs them over the package, TYPE_CHECKING imports and
imports inside functions included, and shows that they catch a back-import and a circle.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter's contracts from `root`/pyproject.toml over the `internlm_offload` package under `root`."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint is not None, "import-linter is a test dependency (pip install -e '.[test]')"
    # The package is found on sys.path, whose first entry is the working directory: `root`'s copy.
    return subprocess.run([lint, "--no-cache", "pyproject.toml"], cwd=root, capture_output=True, text=True)


def test_no_import_runs_back_up_and_no_circles() -> None:
    proc = lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("module", "line", "message"),
    [
        # a low floor reaching up: the device layer importing an optimizer
        ("device/streams.py", "import internlm_offload.optim.swap", "internlm_offload.device is not allowed to import"),
        # a circle inside one package, each import pointing within the floor
        (
            "engine/loss.py",
            "import internlm_offload.engine.trainer",
            "No cycles are allowed in internlm_offload.engine",
        ),
    ],
)
def test_the_contracts_catch_a_back_import_and_a_circle(tmp_path: Path, module: str, line: str, message: str) -> None:
    shutil.copytree(
        REPO / "internlm_offload", tmp_path / "internlm_offload", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    with (tmp_path / "internlm_offload" / module).open("a") as source:
        source.write(f"\n{line}  # noqa\n")
    proc = lint_imports(tmp_path)
    assert proc.returncode == 1 and message in proc.stdout, proc.stdout[-4000:]
