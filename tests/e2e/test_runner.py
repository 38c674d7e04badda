"""The fork server gives a script or module the run a new python process gives it (tests/e2e/fork_server.py)."""

import signal
import subprocess
import sys
import time

import pytest
from runner import ForkedRun, fork_server, run_python, spawn_python

pytestmark = pytest.mark.skipif(fork_server() is None, reason="no fork server on this platform")

SCRIPT = """
import os, signal, sys, time
from pathlib import Path
print("argv", sys.argv[1:], "cwd", os.getcwd() == sys.argv[1], "main", __name__)
print("to stderr", file=sys.stderr)
if sys.argv[2] == "raise":
    raise ValueError("bad value")
if sys.argv[2] == "wait":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(print("stopped", file=sys.stderr) or 5))
    Path(sys.argv[1], "ready").touch()
    while True:
        time.sleep(0.01)
sys.exit(int(sys.argv[2]))
"""


def both(cmd: list[str], cwd) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    forked = run_python(cmd, cwd=cwd)
    real = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60)
    return forked, real


@pytest.mark.parametrize("how", ["0", "3", "raise"])
def test_a_script_exits_and_prints_as_in_a_new_process(tmp_path, how):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    forked, real = both([sys.executable, str(script), str(tmp_path), how], tmp_path)
    assert (forked.returncode, forked.stdout) == (real.returncode, real.stdout)
    assert forked.stderr == real.stderr  # the traceback too


def test_a_module_runs_as_python_dash_m(tmp_path):
    data = tmp_path / "x.json"
    data.write_text('{"b": 1, "a": [1, 2]}')
    forked, real = both([sys.executable, "-m", "json.tool", "--sort-keys", str(data)], tmp_path)
    assert forked.returncode == real.returncode == 0 and forked.stdout == real.stdout


def test_a_started_run_polls_takes_a_signal_and_reports_its_exit(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = spawn_python([sys.executable, str(script), str(tmp_path), "wait"], tmp_path / "run")
    assert isinstance(proc, ForkedRun)
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 5
    assert proc.stderr_path.read_text() == "to stderr\nstopped\n"


def test_a_torchrun_command_forks_one_child_per_rank_with_its_worker_environment(tmp_path):
    """The script's own flags (after its path) are not torchrun's: the run still forks."""
    script = tmp_path / "ranks.py"
    script.write_text("import os, sys\nprint(os.environ['RANK'], os.environ['WORLD_SIZE'], sys.argv[1:])\n")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]
    proc = spawn_python([*launcher, str(script), "--config", "x.py"], tmp_path / "run")
    assert isinstance(proc, ForkedRun) and proc.wait(timeout=60) == 0
    lines = sorted((tmp_path / "run.stdout").read_text().splitlines())
    assert lines == ["0 2 ['--config', 'x.py']", "1 2 ['--config', 'x.py']"]
