"""Tests for the loss-curve comparison tool (internlm_offload.tools.loss_compare)."""

import json
import math
import sys
from pathlib import Path

import pytest
from runner import run_python

from internlm_offload.tools.loss_compare import (
    LossCompareError,
    Tolerance,
    compare,
    load_series,
    main,
    write_golden,
)

LOSSES = [5.545177459716797, 4.9, 0.1 + 0.2, 1e-300, 3.25, 2.0000000001, 1.5, 1.25]


def write_jsonl(path: Path, losses: list[float], start: int = 1, **extra: float) -> Path:
    """Write a metrics.jsonl with one record per loss, steps counting from `start`."""
    lines = [json.dumps({"step": start + i, "loss": v, "lr": 1e-3, **extra}) for i, v in enumerate(losses)]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_main(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str, str]:
    """Call main() in-process and return (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def bumped(losses: list[float], index: int) -> list[float]:
    """Copy of `losses` with one value moved up by one ulp."""
    out = list(losses)
    out[index] = math.nextafter(out[index], math.inf)
    return out


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "base.jsonl", LOSSES)


def test_identical_runs_are_aligned(capsys, tmp_path, base):
    test = write_jsonl(tmp_path / "test.jsonl", LOSSES)
    code, out, _ = run_main(capsys, base, test)
    assert code == 0
    assert out.strip().splitlines()[-1] == "ALIGNED (exact)"
    assert "first divergent step: none" in out
    assert f"compared steps: {len(LOSSES)} " in out
    assert repr(0.1 + 0.2) in out  # the table prints full repr floats


def test_one_ulp_is_misaligned_exactly_but_within_atol(capsys, tmp_path, base):
    test = write_jsonl(tmp_path / "test.jsonl", bumped(LOSSES, 4))  # step 5
    code, out, _ = run_main(capsys, base, test)
    assert code == 1
    assert out.strip().splitlines()[-1].startswith("MISALIGNED (exact): first divergent step 5")
    assert "DIFF" in out
    code, out, _ = run_main(capsys, base, test, "--atol", "1e-6")
    assert code == 0
    assert "ALIGNED (atol=1e-06, rtol=0)" in out


def test_exact_mode_distinguishes_signed_zero():
    assert not Tolerance("exact").matches(0.0, -0.0)
    assert Tolerance("exact").matches(1.5, 1.5)


def test_decimals_mode(capsys, tmp_path):
    base = write_jsonl(tmp_path / "base.jsonl", [1.0, 2.0, 3.0])
    test = write_jsonl(tmp_path / "test.jsonl", [1.0, 2.0004, 3.0])
    assert run_main(capsys, base, test, "--decimals", "3")[0] == 0
    code, out, _ = run_main(capsys, base, test, "--decimals", "4")
    assert code == 1
    assert "MISALIGNED (decimals=4): first divergent step 2" in out


def test_rtol_mode(capsys, tmp_path):
    base = write_jsonl(tmp_path / "base.jsonl", [100.0, 200.0])
    test = write_jsonl(tmp_path / "test.jsonl", [100.0, 200.1])  # relative diff 5e-4
    assert run_main(capsys, base, test, "--rtol", "1e-3")[0] == 0
    assert run_main(capsys, base, test, "--rtol", "1e-4")[0] == 1
    # atol and rtol add up: 0.05 + 1e-4 * 200 = 0.07 < 0.1, 0.09 + 0.02 = 0.11 >= 0.1
    assert run_main(capsys, base, test, "--rtol", "1e-4", "--atol", "0.05")[0] == 1
    assert run_main(capsys, base, test, "--rtol", "1e-4", "--atol", "0.09")[0] == 0


def test_run_directory_input(capsys, tmp_path, base):
    run_dir = tmp_path / "work_dirs" / "offload"
    run_dir.mkdir(parents=True)
    write_jsonl(run_dir / "metrics.jsonl", LOSSES)
    assert load_series(run_dir) == load_series(base)
    assert run_main(capsys, base, run_dir)[0] == 0


def test_other_metric(capsys, tmp_path):
    base = write_jsonl(tmp_path / "base.jsonl", [1.0, 2.0], grad_norm=0.5)
    test = write_jsonl(tmp_path / "test.jsonl", [1.0, 2.0], grad_norm=0.75)
    assert run_main(capsys, base, test)[0] == 0
    code, out, _ = run_main(capsys, base, test, "--metric", "grad_norm")
    assert code == 1
    assert "grad_norm" in out


def test_golden_round_trip_is_bitwise(capsys, tmp_path, base):
    golden = tmp_path / "golden" / "nested" / "loss.txt"
    code, out, _ = run_main(capsys, base, "--export", golden)
    assert code == 0
    assert "exported" in out
    text = golden.read_text()
    assert text.startswith("#") and "loss" in text.splitlines()[0] and str(base) in text.splitlines()[0]
    assert f"3 {0.1 + 0.2!r}" in text and "4 1e-300" in text
    reloaded = load_series(golden)
    assert [v.hex() for v in reloaded.values()] == [v.hex() for v in LOSSES]
    assert run_main(capsys, golden, base)[0] == 0
    assert run_main(capsys, base, golden)[0] == 0


def test_golden_detects_a_one_ulp_change(capsys, tmp_path, base):
    golden = tmp_path / "loss.txt"
    write_golden(load_series(base), golden, "loss", base)
    test = write_jsonl(tmp_path / "test.jsonl", bumped(LOSSES, 3))  # the 1e-300 value
    code, out, _ = run_main(capsys, golden, test)
    assert code == 1
    assert "first divergent step 4" in out


def test_export_respects_steps_window(capsys, tmp_path, base):
    golden = tmp_path / "loss.txt"
    assert run_main(capsys, base, "--export", golden, "--steps", "3:5")[0] == 0
    assert list(load_series(golden)) == [3, 4, 5]


def test_steps_window_excludes_divergence(capsys, tmp_path, base):
    test = write_jsonl(tmp_path / "test.jsonl", bumped(LOSSES, 6))  # step 7
    assert run_main(capsys, base, test)[0] == 1
    assert run_main(capsys, base, test, "--steps", ":6")[0] == 0
    assert run_main(capsys, base, test, "--steps", "8:")[0] == 0
    assert run_main(capsys, base, test, "--steps", "2:7")[0] == 1


def test_missing_step_is_misaligned(capsys, tmp_path, base):
    test = write_jsonl(tmp_path / "test.jsonl", LOSSES[:-2])
    code, out, _ = run_main(capsys, base, test, "--quiet")
    assert code == 1
    assert "only in baseline: 7, 8" in out
    assert "2 step(s) missing in test" in out
    assert "status" not in out  # --quiet drops the table
    # The window can cut the missing steps away.
    assert run_main(capsys, base, test, "--steps", ":6")[0] == 0


def test_missing_steps_list_is_capped(capsys, tmp_path):
    base = write_jsonl(tmp_path / "base.jsonl", [1.0] * 30)
    test = write_jsonl(tmp_path / "test.jsonl", [1.0])
    code, out, _ = run_main(capsys, base, test, "--quiet")
    assert code == 1
    assert "only in baseline: 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, ... (+19 more)" in out


def test_compare_api():
    result = compare({1: 1.0, 2: 2.0, 3: 3.0}, {1: 1.0, 2: 2.5, 3: 3.0, 4: 4.0}, Tolerance("exact"))
    assert result.steps == [1, 2, 3]
    assert result.first_divergent_step == 2
    assert (result.max_abs_diff, result.max_abs_diff_step) == (0.5, 2)
    assert result.only_in_test == [4] and result.only_in_baseline == []
    assert result.rows[1] == (2, 2.0, 2.5, 0.5, False)
    assert not result.aligned
    assert compare({1: 1.0}, {1: 1.0}, Tolerance("exact")).aligned


def write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("nan.jsonl", '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": NaN}\n', "step 2: loss is nan"),
        ("inf.txt", "1 1.0\n2 inf\n", "step 2: loss is inf"),
        ("dup.jsonl", '{"step": 1, "loss": 1.0}\n\n{"step": 1, "loss": 1.0}\n', ":3: duplicate step 1"),
        ("bad.jsonl", '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": \n', ":2: invalid JSON"),
        ("bad.txt", "# header\n1 1.0\n2 one\n", ":3: cannot parse '2 one'"),
        (
            "nokey.jsonl",
            '{"step": 1, "loss": 1.0}\n{"step": 2, "lr": 0.1}\n',
            ":2: record for step 2 has no key 'loss'",
        ),
        ("empty.txt", "# only a header\n", "no loss values found"),
    ],
)
def test_bad_input_files(capsys, tmp_path, base, name, content, expected):
    bad = write_text(tmp_path / name, content)
    code, out, err = run_main(capsys, base, bad)
    assert code == 2
    assert out == ""
    assert err.startswith("loss_compare: error: ") and str(bad) in err and expected in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    with pytest.raises(LossCompareError):
        load_series(bad)


def test_missing_path_and_dir_without_metrics(capsys, tmp_path, base):
    code, _, err = run_main(capsys, base, tmp_path / "nope.jsonl")
    assert code == 2
    assert err.strip() == f"loss_compare: error: {tmp_path / 'nope.jsonl'}: no such file or directory"
    code, _, err = run_main(capsys, tmp_path, base)
    assert code == 2
    assert err.strip() == f"loss_compare: error: {tmp_path}: directory has no metrics.jsonl"


def test_no_common_steps(capsys, tmp_path, base):
    test = write_jsonl(tmp_path / "test.jsonl", [1.0, 2.0], start=100)
    code, _, err = run_main(capsys, base, test)
    assert code == 2
    assert err.strip() == f"loss_compare: error: no common steps between {base} and {test}"
    code, _, err = run_main(capsys, base, base, "--steps", "50:60")
    assert code == 2
    assert "no common steps" in err and "--steps 50:60" in err


@pytest.mark.parametrize(
    "options, expected",
    [
        (["--atol=-1e-6"], "--atol must be a finite number >= 0, got -1e-06"),
        (["--rtol", "nan"], "--rtol must be a finite number >= 0, got nan"),
        (["--decimals", "-2"], "--decimals must be >= 0, got -2"),
        (["--steps", "9:3"], "--steps start is after end: '9:3'"),
        (["--steps", "a:b"], "--steps expects A:B with optional integer ends, got 'a:b'"),
        (["--steps", "5"], "--steps expects A:B"),
    ],
)
def test_bad_option_values(capsys, base, options, expected):
    code, out, err = run_main(capsys, base, base, *options)
    assert code == 2
    assert out == ""
    assert err.strip().startswith(f"loss_compare: error: {expected}")


def test_usage_errors(capsys, base):
    code, _, err = run_main(capsys, base)
    assert code == 2
    assert "TEST is required unless --export is given" in err
    code, _, err = run_main(capsys, base, base, "--exact", "--atol", "1e-3")
    assert code == 2
    assert "mutually exclusive" in err


def test_plot_writes_png(capsys, tmp_path, base):
    test = write_jsonl(tmp_path / "test.jsonl", bumped(LOSSES, 2))
    png = tmp_path / "plots" / "deep" / "loss.png"
    code, _, _ = run_main(capsys, base, test, "--plot", png, "--quiet")
    assert code == 1
    assert png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_module_entry_point_exit_codes(tmp_path, base):
    test = write_jsonl(tmp_path / "test.jsonl", bumped(LOSSES, 0))
    cmd = [sys.executable, "-m", "internlm_offload.tools.loss_compare", str(base), str(test), "--quiet"]
    proc = run_python(cmd, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "MISALIGNED (exact): first divergent step 1" in proc.stdout
    proc = run_python(cmd[:-2] + [str(tmp_path / "missing")], timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("loss_compare: error: ") and "Traceback" not in proc.stderr
