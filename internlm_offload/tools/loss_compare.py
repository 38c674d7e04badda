"""Compare a metric (loss by default) step by step between two runs or a run and a golden file.

Inputs are a run directory (its metrics.jsonl), a metrics.jsonl file, or a golden text file
(`<step> <repr(float)>` lines, `#` comments). Exit codes: 0 aligned, 1 misaligned, 2 bad input.
"""

import argparse
import json
import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from internlm_offload.log import get_logger

logger = get_logger(__name__)

PROG = "loss_compare"
MAX_LISTED = 10  # how many missing steps to name before eliding the rest


class LossCompareError(ValueError):
    """Bad input: unreadable file, malformed record, non-finite value, bad option."""


def _to_float(value: object, where: str, metric: str) -> float:
    """Convert a parsed value to a finite float or raise naming where it came from."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LossCompareError(f"{where}: {metric} is not a number: {value!r}")
    try:
        result = float(value)
    except OverflowError:
        raise LossCompareError(f"{where}: {metric} overflows a float: {value!r}") from None
    if not math.isfinite(result):
        raise LossCompareError(f"{where}: {metric} is {result}")
    return result


def _is_jsonl(path: Path, lines: list[str]) -> bool:
    """Decide the format from the first non-blank, non-comment line."""
    for line in lines:
        text = line.strip()
        if text and not text.startswith("#"):
            return text.startswith("{")
    return path.suffix == ".jsonl"


def _parse_jsonl(path: Path, lines: list[str], metric: str) -> list[tuple[int, int, float]]:
    """Parse metrics.jsonl lines into (line number, step, value)."""
    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LossCompareError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise LossCompareError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        step = obj.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise LossCompareError(f"{path}:{lineno}: 'step' missing or not an int: {step!r}")
        if metric not in obj and metric != "loss":
            continue  # sparse metrics (valid_loss) exist only at the steps that measured them
        if metric not in obj:
            raise LossCompareError(f"{path}:{lineno}: record for step {step} has no key {metric!r}")
        records.append((lineno, step, _to_float(obj[metric], f"{path}: step {step}", metric)))
    return records


def _parse_golden(path: Path, lines: list[str], metric: str) -> list[tuple[int, int, float]]:
    """Parse golden text lines (`<step> <float>`) into (line number, step, value)."""
    records = []
    for lineno, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        parts = text.split()
        try:
            if len(parts) != 2:
                raise ValueError
            step, value = int(parts[0]), float(parts[1])
        except ValueError:
            raise LossCompareError(f"{path}:{lineno}: cannot parse {text!r} as '<step> <value>'") from None
        records.append((lineno, step, _to_float(value, f"{path}: step {step}", metric)))
    return records


def load_series(path: str | Path, metric: str = "loss") -> dict[int, float]:
    """Load {step: value} for `metric` from a run dir, a metrics.jsonl, or a golden text file."""
    path = Path(path)
    if path.is_dir():
        if not (path / "metrics.jsonl").is_file():
            raise LossCompareError(f"{path}: directory has no metrics.jsonl")
        path = path / "metrics.jsonl"
    elif not path.exists():
        raise LossCompareError(f"{path}: no such file or directory")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise LossCompareError(f"{path}: cannot read ({exc})") from None
    parse = _parse_jsonl if _is_jsonl(path, lines) else _parse_golden
    series: dict[int, float] = {}
    for lineno, step, value in parse(path, lines, metric):
        # A resumed run that failed to truncate its log repeats steps; refuse rather than guess.
        if step in series:
            raise LossCompareError(f"{path}:{lineno}: duplicate step {step}")
        series[step] = value
    if not series:
        raise LossCompareError(f"{path}: no {metric} values found")
    logger.debug("loaded %d steps of %s from %s", len(series), metric, path)
    return series


@dataclass(frozen=True)
class Tolerance:
    """How two values of the same step are judged equal."""

    mode: str = "exact"  # "exact" | "decimals" | "close"
    decimals: int | None = None
    atol: float = 0.0
    rtol: float = 0.0

    def matches(self, b: float, t: float) -> bool:
        """True if test value `t` matches baseline value `b` under this tolerance."""
        if self.mode == "exact":
            # Bitwise, so 0.0 vs -0.0 counts as a difference.
            return struct.pack("<d", b) == struct.pack("<d", t)
        if self.mode == "decimals":
            return round(b, self.decimals) == round(t, self.decimals)
        return abs(t - b) <= self.atol + self.rtol * abs(b)

    def describe(self) -> str:
        """Short label for summaries and plot titles."""
        if self.mode == "exact":
            return "exact"
        if self.mode == "decimals":
            return f"decimals={self.decimals}"
        return f"atol={self.atol:g}, rtol={self.rtol:g}"


@dataclass(frozen=True)
class Comparison:
    """Per-step result of comparing a test series against a baseline."""

    steps: list[int]
    rows: list[tuple[int, float, float, float, bool]]  # (step, baseline, test, |diff|, matches)
    only_in_baseline: list[int]
    only_in_test: list[int]
    first_divergent_step: int | None
    max_abs_diff: float
    max_abs_diff_step: int | None

    @property
    def aligned(self) -> bool:
        """All common steps match and neither side has extra steps."""
        missing = self.only_in_baseline or self.only_in_test
        return bool(self.rows) and self.first_divergent_step is None and not missing


def compare(baseline: dict[int, float], test: dict[int, float], tol: Tolerance) -> Comparison:
    """Compare the two series on their common steps; raise if they share none."""
    steps = sorted(baseline.keys() & test.keys())
    if not steps:
        raise LossCompareError("no common steps between baseline and test")
    rows = []
    for step in steps:
        b, t = baseline[step], test[step]
        rows.append((step, b, t, abs(t - b), tol.matches(b, t)))
    first_bad = next((s for s, *_, ok in rows if not ok), None)
    max_step, max_diff = max(((s, d) for s, _, _, d, _ in rows), key=lambda sd: sd[1])
    return Comparison(
        steps=steps,
        rows=rows,
        only_in_baseline=sorted(baseline.keys() - test.keys()),
        only_in_test=sorted(test.keys() - baseline.keys()),
        first_divergent_step=first_bad,
        max_abs_diff=max_diff,
        max_abs_diff_step=max_step if max_diff > 0 else None,
    )


def write_golden(series: dict[int, float], path: str | Path, metric: str, source: str | Path) -> None:
    """Write `series` as golden text; repr() round-trips every float exactly."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# loss_compare golden: metric={metric} source={source}"]
    lines += [f"{step} {float(value)!r}" for step, value in sorted(series.items())]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def parse_window(spec: str) -> tuple[int | None, int | None]:
    """Parse `A:B` (inclusive, either side optional) into (start, end)."""
    start, sep, end = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        window = (int(start) if start.strip() else None, int(end) if end.strip() else None)
    except ValueError:
        raise LossCompareError(f"--steps expects A:B with optional integer ends, got {spec!r}") from None
    if window[0] is not None and window[1] is not None and window[0] > window[1]:
        raise LossCompareError(f"--steps start is after end: {spec!r}")
    return window


def in_window(series: dict[int, float], window: tuple[int | None, int | None]) -> dict[int, float]:
    """Keep only steps inside the inclusive window."""
    lo, hi = window
    return {s: v for s, v in series.items() if (lo is None or s >= lo) and (hi is None or s <= hi)}


def _listed(steps: list[int]) -> str:
    """Up to MAX_LISTED steps, comma separated, with a count of the rest."""
    shown = ", ".join(map(str, steps[:MAX_LISTED]))
    return shown + (f", ... (+{len(steps) - MAX_LISTED} more)" if len(steps) > MAX_LISTED else "")


def verdict(result: Comparison, tol: Tolerance) -> str:
    """The final one-line verdict."""
    if result.aligned:
        return f"ALIGNED ({tol.describe()})"
    reasons = []
    if result.first_divergent_step is not None:
        reasons.append(f"first divergent step {result.first_divergent_step}")
        reasons.append(f"max |diff| {result.max_abs_diff:.3g} at step {result.max_abs_diff_step}")
    if result.only_in_baseline:
        reasons.append(f"{len(result.only_in_baseline)} step(s) missing in test")
    if result.only_in_test:
        reasons.append(f"{len(result.only_in_test)} step(s) missing in baseline")
    return f"MISALIGNED ({tol.describe()}): " + ", ".join(reasons)


def report(result: Comparison, tol: Tolerance, metric: str, quiet: bool) -> str:
    """The per-step table (unless quiet) followed by the summary and verdict."""
    lines = []
    if not quiet:
        lines.append(f"{'step':>8}  {'baseline':>24}  {'test':>24}  {'abs diff':>24}  status")
        for step, b, t, diff, ok in result.rows:
            lines.append(f"{step:>8}  {b!r:>24}  {t!r:>24}  {diff!r:>24}  {'ok' if ok else 'DIFF'}")
    at = f" at step {result.max_abs_diff_step}" if result.max_abs_diff_step is not None else ""
    first = result.first_divergent_step
    lines.append(f"compared steps: {len(result.steps)} ({metric}, {tol.describe()})")
    lines.append(f"max |diff|: {result.max_abs_diff!r}{at}")
    lines.append(f"first divergent step: {'none' if first is None else first}")
    if result.only_in_baseline:
        lines.append(f"only in baseline: {_listed(result.only_in_baseline)}")
    if result.only_in_test:
        lines.append(f"only in test: {_listed(result.only_in_test)}")
    lines.append(verdict(result, tol))
    return "\n".join(lines)


def plot(
    baseline: dict[int, float], test: dict[int, float], result: Comparison, tol: Tolerance, metric: str, out: Path
) -> None:
    """Save curves (top) and test-baseline difference (bottom) to `out`."""
    import matplotlib

    matplotlib.use("Agg")  # headless: must be chosen before pyplot is imported
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6), height_ratios=[2, 1])
    # Dashed test line so an identical baseline underneath stays visible.
    for label, series, style in (("baseline", baseline, "-"), ("test", test, "--")):
        steps = sorted(series)
        top.plot(steps, [series[s] for s in steps], style, label=label, linewidth=1.2)
    top.set_ylabel(metric)
    top.legend()
    bottom.plot(result.steps, [t - b for _, b, t, _, _ in result.rows], color="tab:red", linewidth=1.0)
    bottom.axhline(0.0, color="gray", linewidth=0.6)
    bottom.set_xlabel("step")
    bottom.set_ylabel("test - baseline")
    top.set_title(verdict(result, tol), fontsize=9)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("baseline", help="run dir, metrics.jsonl, or golden text file")
    p.add_argument("test", nargs="?", help="run dir, metrics.jsonl, or golden text file")
    p.add_argument("--metric", default="loss", help="key to compare (default: loss)")
    p.add_argument("--exact", action="store_true", help="bitwise float equality per step (default)")
    p.add_argument("--decimals", type=int, help="equal after rounding both to N decimals")
    p.add_argument("--atol", type=float, help="absolute tolerance: |t-b| <= atol + rtol*|b|")
    p.add_argument("--rtol", type=float, help="relative tolerance: |t-b| <= atol + rtol*|b|")
    p.add_argument("--steps", help="inclusive window A:B, either side optional (e.g. 5: or :10)")
    p.add_argument("--plot", type=Path, help="save a curve + difference plot (PNG)")
    p.add_argument("--export", type=Path, help="write the baseline's metric as a golden text file")
    p.add_argument("--quiet", action="store_true", help="print only the summary, not the per-step table")
    return p


def tolerance_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Tolerance:
    """Build the Tolerance from the mutually exclusive mode options."""
    close = args.atol is not None or args.rtol is not None
    if sum([args.exact, args.decimals is not None, close]) > 1:
        parser.error("--exact, --decimals and --atol/--rtol are mutually exclusive")
    if args.decimals is not None:
        if args.decimals < 0:
            raise LossCompareError(f"--decimals must be >= 0, got {args.decimals}")
        return Tolerance("decimals", decimals=args.decimals)
    if close:
        for name in ("atol", "rtol"):
            value = getattr(args, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise LossCompareError(f"--{name} must be a finite number >= 0, got {value}")
        return Tolerance("close", atol=args.atol or 0.0, rtol=args.rtol or 0.0)
    return Tolerance("exact")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Execute the parsed command; raise LossCompareError on bad input."""
    if args.test is None and args.export is None:
        parser.error("TEST is required unless --export is given")
    if args.test is None and args.plot is not None:
        parser.error("--plot needs TEST")
    tol = tolerance_from_args(args, parser)
    window = parse_window(args.steps) if args.steps else (None, None)
    baseline = in_window(load_series(args.baseline, args.metric), window)
    if args.export is not None:
        if not baseline:
            raise LossCompareError(f"{args.baseline}: no steps inside --steps {args.steps}")
        write_golden(baseline, args.export, args.metric, args.baseline)
        print(f"exported {len(baseline)} steps of {args.metric} to {args.export}")
        if args.test is None:
            return 0
    test = in_window(load_series(args.test, args.metric), window)
    if not baseline.keys() & test.keys():
        where = f" inside --steps {args.steps}" if args.steps else ""
        raise LossCompareError(f"no common steps between {args.baseline} and {args.test}{where}")
    result = compare(baseline, test, tol)
    print(report(result, tol, args.metric, args.quiet))
    if args.plot is not None:
        plot(baseline, test, result, tol, args.metric, args.plot)
        print(f"plot written to {args.plot}")
    return 0 if result.aligned else 1


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (0 aligned, 1 misaligned, 2 bad input)."""
    parser = build_parser()
    try:
        return run(parser.parse_args(argv), parser)
    except LossCompareError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # argparse usage errors and --help; report as a return value
        return exc.code if isinstance(exc.code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
