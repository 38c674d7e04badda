"""How much of a step's copying overlaps compute: `python -m internlm_offload.tools.trace_overlap TRACE`.

TRACE is a Chrome trace written by `monitor.profile_step` (or any `torch.profiler` trace with device
activity, `.json` or `.json.gz`). Device copies are its `gpu_memcpy` events, compute its `kernel` events;
a copy's time counts as hidden where some kernel runs at the same moment. Prints one JSON object: per
direction (HtoD, DtoH, other) the copies' count, busy time and hidden fraction, and the kernels' busy time.
Exit code 0; 2 when the file cannot be read or holds no device events (a cpu run's trace records host
operators only: the side-stream threads are not profiled).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Iterable
from pathlib import Path

Interval = tuple[float, float]  # (start, end) in microseconds


def merged(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of `intervals` as sorted, disjoint intervals (touching ones are joined)."""
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covered(spans: list[Interval], by: list[Interval]) -> float:
    """Length of the union of `spans` that lies inside the union of `by`."""
    a, b = merged(spans), merged(by)
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total


def busy(spans: list[Interval]) -> float:
    return sum(end - start for start, end in merged(spans))


def direction(name: str) -> str:
    """Kineto names copies `Memcpy HtoD (Pinned -> Device)` and the like."""
    return next((d for d in ("HtoD", "DtoH") if d in name), "other")


def overlap_report(events: list[dict]) -> dict:
    """Copies per direction (count, busy time, hidden fraction) and the kernels' busy time, in microseconds."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") == "kernel"]
    report: dict = {"kernel_busy_us": round(busy(kernels), 1), "copies": {}}
    for name in ("HtoD", "DtoH", "other"):
        copies = [
            (e["ts"], e["ts"] + e["dur"])
            for e in spans
            if e.get("cat") == "gpu_memcpy" and direction(e["name"]) == name
        ]
        if copies:
            copy_busy = busy(copies)
            report["copies"][name] = {
                "count": len(copies),
                "busy_us": round(copy_busy, 1),
                "hidden_fraction": round(covered(copies, kernels) / copy_busy, 4) if copy_busy else 1.0,
            }
    return report


def read_trace(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measure how much device copying overlaps kernels in a trace.")
    parser.add_argument("trace", type=Path, help="a Chrome trace (.json or .json.gz) from monitor.profile_step")
    args = parser.parse_args(argv)
    try:
        events = read_trace(args.trace)
    except (OSError, ValueError, KeyError) as exc:
        sys.stderr.write(f"trace_overlap: cannot read {args.trace}: {exc}\n")
        return 2
    if not any(e.get("cat") in ("kernel", "gpu_memcpy") for e in events):
        sys.stderr.write(f"trace_overlap: {args.trace} holds no device events (kernel / gpu_memcpy): a cpu trace\n")
        return 2
    sys.stdout.write(json.dumps(overlap_report(events), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
