"""How long the planner takes to answer: wall time, candidates and traces per question, as JSON.

    python -m internlm_offload.bench.planner_speed [--questions 7b-8gib 70b-8-ranks 7b-preflight]
        [--out bench_results/planner]

Each search question runs `tools/plan` in this process (its own `--json` gives the candidates and the
traces it took, reduced models and whole ones); the preflight question times `planner.preflight.predict`
of the 7B run as `train.py` calls it. Writes `planner_speed.json`: one row per question with its command
line, wall seconds, exit code, candidates, traces and verdict.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.tools import plan

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "internlm2_tiny.py")
SHAPE_7B = [
    "model.num_layers=32",
    "model.hidden_size=4096",
    "model.num_attention_heads=32",
    "model.num_kv_attention_heads=8",
    "model.mlp_ratio=3.5",
    "model.multiple_of=256",
    "model.vocab_size=92544",
    "model.dtype=torch.bfloat16",
    "data.seq_len=4096",
    "data.micro_bsz=1",
    "data.micro_num=4",
]
SHAPE_70B = [
    "model.num_layers=80",
    "model.hidden_size=8192",
    "model.num_attention_heads=64",
    "model.num_kv_attention_heads=8",
    "model.mlp_ratio=3.5",
    "model.multiple_of=256",
    "model.vocab_size=128256",
    "model.dtype=torch.bfloat16",
    "data.seq_len=4096",
    "data.micro_bsz=1",
    "data.micro_num=4",
]
# question -> tools/plan's arguments (every knob searched: no parallel mode given)
QUESTIONS: dict[str, list[str]] = {
    "7b-8gib": ["--config", TINY, "--device-memory", "8GiB", "--host-memory", "2TiB", "--cfg-options", *SHAPE_7B],
    "7b-24gib": ["--config", TINY, "--device-memory", "24GiB", "--host-memory", "2TiB", "--cfg-options", *SHAPE_7B],
    "70b-8-ranks": [
        "--config",
        TINY,
        "--world-size",
        "8",
        "--ranks-per-node",
        "8",
        "--device-memory",
        "80GiB",
        "--host-memory",
        "1TiB",  # 128 GiB per rank
        "--cfg-options",
        *SHAPE_70B,
        "parallel.tensor.size=8",
    ],
}
PREFLIGHT = "7b-preflight"


def ask(name: str, argv: list[str]) -> dict[str, Any]:
    """One search question through `tools/plan`: its wall time and what its JSON reports."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "plan.json"
        start = time.perf_counter()
        code = plan.main([*argv, "--no-progress", "--json", str(report)])
        wall = time.perf_counter() - start
        answer = json.loads(report.read_text()) if report.exists() else {}
    return {
        "question": name,
        "argv": argv,
        "wall_s": round(wall, 2),
        "exit_code": code,
        "candidates": len(answer.get("search") or []),
        "traces": answer.get("traces"),
        "verdict": answer.get("verdict"),
    }


def preflight_row() -> dict[str, Any]:
    """The 7B run's preflight prediction, as `train.py` makes it before building the model."""
    from internlm_offload.planner.preflight import predict

    options = plan.parse_args(["--config", TINY, "--cfg-options", *SHAPE_7B]).cfg_options
    cfg = resolve_config(load_config_file(TINY, options))
    start = time.perf_counter()
    prediction = predict(cfg, world_size=1)
    wall = time.perf_counter() - start
    return {
        "question": PREFLIGHT,
        "argv": ["--config", TINY, "--cfg-options", *SHAPE_7B],
        "wall_s": round(wall, 2),
        "device_peak_bytes": prediction.device_peak,
        "host_peak_bytes": prediction.host_peak,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", nargs="+", choices=[*QUESTIONS, PREFLIGHT], default=[*QUESTIONS, PREFLIGHT])
    parser.add_argument("--out", type=Path, default=REPO / "bench_results" / "planner")
    args = parser.parse_args(argv)
    rows = [preflight_row() if name == PREFLIGHT else ask(name, QUESTIONS[name]) for name in args.questions]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "planner_speed.json").write_text(json.dumps({"rows": rows}, indent=2))
    for row in rows:
        counts = f", {row['candidates']} candidates, {row['traces']} traces" if "traces" in row else ""
        print(f"{row['question']}: {row['wall_s']} s{counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
