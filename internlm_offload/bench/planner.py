"""The memory planner checked against measurement: predicted vs measured device peak on cpu, per setting.

    python -m internlm_offload.bench.planner [--config configs/planner_validation.py] [--settings a b ...]
        [--steps 3] [--out bench_results/planner]

For each memory setting the planner traces the config on meta tensors (`planner.trace.trace_step`) and
predicts the steady step's device peak; `train.py` then runs the same config for `--steps` steps in a
process of its own, and the measured figure is the largest `device_peak_mem_bytes` of the steps after
the first (on cpu: the sampled peak of `RssAnon` above what it was before the model was built; see
`internlm_offload/device/cpu_memory.py`). The cost model's step time with this machine's calibrated row
(`planner.cost.calibrate`) stands beside the measured median step time. Writes
`planner_validation.json` (per setting: options, predictions, measured figures per step, error),
`planner_validation.md` (the table) and `planner_validation.png`. The FSDP2 settings run on 2 and 4
processes (torchrun, gloo); their figures are rank 0's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.planner.cost import Hardware, calibrate, step_time
from internlm_offload.tools.plan import option_strings

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "planner_validation.py"
OFFLOAD = {"cpu_offloading.enable": True}
# Gradient offload's rows: bf16 with fp32 masters, activations recomputed, two micro-batches: the fp32
# gradient buffer (beside the second backward) is then part of the peak, as at 7B.
BF16_LEAN = {"model.dtype": "torch.bfloat16", "model.checkpoint": 1.0, "data.micro_num": 2}
HYBRID_ALL = {"hybrid_optimizer.enable": True, "hybrid_optimizer.offload_fraction": 1.0}
# LoRA r=8 on every projection of the frozen bf16 base (docs/lora.md's 26 M-parameter shape: 8 blocks, 8 kv heads,
# 2 x 64 tokens): the base with no gradient, master or state, the adapters' fp32 masters and AdamW states, the
# activations through PEFT's layers. Small on purpose: the kernels' own memory is a fixed few MiB, so a probe that
# misses the adapters' kernels shows here (-8 %) where it hides in a larger model (-4.8 % at 12 blocks x 128 x 4).
LORA = {
    "model.dtype": "torch.bfloat16",
    "model.lora.r": 8,
    "model.lora.lora_alpha": 16,
    "model.lora.target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "model.num_layers": 8,
    "model.num_kv_attention_heads": 8,
    "data.seq_len": 64,
    "data.micro_bsz": 2,
}
# The DeepSeek-V3 lineage (model.type="deepseek_v3", docs/deepseek.md) built from config.json's keys: multi-head latent
# attention with v's head dim apart from q/k's (cpu runs its math path), 2 dense-first blocks before 4 sparse ones (8
# experts, top-2 of the sigmoid router in 1 of 2 groups, its fp32 scores and bias; a shared expert); half the blocks
# recomputed, across both kinds.
DEEPSEEK_CONFIG = {
    "model_type": "deepseek_v3",
    "hidden_size": 128,
    "intermediate_size": 384,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 6,
    "first_k_dense_replace": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "vocab_size": 259,
}
DEEPSEEK = {
    "model.type": "deepseek_v3",
    **{f"model.hf_config.{key}": value for key, value in DEEPSEEK_CONFIG.items()},
    "model.checkpoint": 0.5,
}
# GLM-5's DeepSeek sparse attention on that model (docs/deepseek.md): an indexer of 4 heads x 32 keeping 64 keys per
# query, below the validation sequence, blocks alternately owning an indexer and sharing the last one's top-k.
GLM5_DSA = {
    **DEEPSEEK,
    "model.hf_config.model_type": "glm_moe_dsa",
    "model.hf_config.n_group": 1,
    "model.hf_config.index_topk": 64,
    "model.hf_config.index_n_heads": 4,
    "model.hf_config.index_head_dim": 32,
    "model.hf_config.indexer_types": ["full", "shared"] * 3,
}
# Qwen3-Next (model.type="qwen3_next", docs/qwen3_next.md) built from config.json's keys: 8 blocks, three Gated DeltaNet
# (the causal conv, the chunked rule's buffers: chunks of 64, the UT transform's solves, the state scanned over chunks)
# for every gated full attention, every block 8 experts (top-2) beside the sigmoid-gated shared expert; half the blocks
# recomputed (blocks 0-3: three DeltaNet, one attention).
QWEN3_NEXT_CONFIG = {
    "model_type": "qwen3_next",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 259,
}
QWEN3_NEXT = {
    "model.type": "qwen3_next",
    **{f"model.hf_config.{key}": value for key, value in QWEN3_NEXT_CONFIG.items()},
    "model.checkpoint": 0.5,
}
SETTINGS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "offload 3": {**OFFLOAD, "cpu_offloading.num_layers": 3},
    "offload 6": {**OFFLOAD, "cpu_offloading.num_layers": 6},
    "offload 11": {**OFFLOAD, "cpu_offloading.num_layers": 11},
    "ckpt 0.5": {"model.checkpoint": 0.5},
    "ckpt 1.0": {"model.checkpoint": 1.0},
    "ckpt 0.5 + offload 6": {"model.checkpoint": 0.5, **OFFLOAD, "cpu_offloading.num_layers": 6},
    "swap": {"swap_optimizer": True, "swap_optimizer_times": 4},
    # Muon (docs/planner.md, Muon): one state per matrix element, Newton-Schulz's bf16 buffers in the step
    "muon": {"optimizer.type": "muon"},
    "muon + swap": {"optimizer.type": "muon", "swap_optimizer": True, "swap_optimizer_times": 4},
    "hybrid 0.5": {"hybrid_optimizer.enable": True, "hybrid_optimizer.offload_fraction": 0.5},
    "bf16 ckpt 1.0 + swap": {**BF16_LEAN, "swap_optimizer": True, "swap_optimizer_times": 4},
    "bf16 ckpt 1.0 + swap + grad offload": {
        **BF16_LEAN,
        "swap_optimizer": True,
        "swap_optimizer_times": 4,
        "grad_offload": True,
    },
    "bf16 ckpt 1.0 + hybrid 1.0": {**BF16_LEAN, **HYBRID_ALL},
    "bf16 ckpt 1.0 + hybrid 1.0 + grad offload": {**BF16_LEAN, **HYBRID_ALL, "grad_offload": True},
    "all": {
        "model.checkpoint": 0.5,
        "selective_checkpoint": True,
        "selective_checkpoint_offload": True,
        **OFFLOAD,
        "cpu_offloading.num_layers": 3,
        "swap_optimizer": True,
        "swap_optimizer_times": 4,
        "use_pinned_optimizer_offload": True,
    },
    "lora r=8 bf16": LORA,
    "deepseek mla 2 dense + 4 sparse + ckpt 0.5": DEEPSEEK,
    "glm5 dsa top-64 + ckpt 0.5": GLM5_DSA,
    "qwen3_next 6 deltanet + 2 attention + ckpt 0.5": QWEN3_NEXT,
    "fsdp2 x2": {"parallel.mode": "fsdp2"},
    "fsdp2 x4 + swap + ckpt 0.5": {"parallel.mode": "fsdp2", "swap_optimizer": True, "model.checkpoint": 0.5},
    "mtp 2": {"parallel.tensor.size": 2, "parallel.tensor.mode": "mtp"},
    "msp 2": {"parallel.tensor.size": 2, "parallel.tensor.mode": "msp"},
    "fsp 2": {"parallel.tensor.size": 2, "parallel.tensor.mode": "fsp"},
    "isp 2": {"parallel.tensor.size": 2, "parallel.tensor.mode": "isp", "parallel.mode": "ddp"},
    "msp 2 x fsdp2 2 + offload 3": {
        "parallel.tensor.size": 2,
        "parallel.tensor.mode": "msp",
        "parallel.mode": "fsdp2",
        **OFFLOAD,
        "cpu_offloading.num_layers": 3,
    },
    "isp 2 x weight 2 + swap": {
        "parallel.tensor.size": 2,
        "parallel.tensor.mode": "isp",
        "parallel.mode": "fsdp2",
        "parallel.weight.size": 2,
        "swap_optimizer": True,
    },
    "fsp 4 over 2 kv heads": {
        "parallel.tensor.size": 4,
        "parallel.tensor.mode": "fsp",
        "model.num_kv_attention_heads": 2,
    },  # wk and wv whole on each rank (KVHeadReplicas)
    # stacked experts through the grouped GEMM (cpu), traced on meta; a shared expert; activation offload
    "moe 8 x top-2 dropless + offload 3": {
        "model.num_experts": 8,
        "model.top_k": 2,
        "model.moe_type": "Dropless",
        "model.num_shared_experts": 1,
        "model.mlp_ratio": 1.0,
        **OFFLOAD,
        "cpu_offloading.num_layers": 3,
    },
    # expert parallel: each rank 4 of the 8 experts, rows sent by all-to-all (the trace's receive buffers at
    # memory_budget.expert_imbalance's assumption: 1.0, even, as a fresh router spreads this corpus's tokens), the
    # experts their own FSDP2 unit over the expert-data dim (of size 1 on 2 processes, 2 on 4)
    "moe ep 2 x fsdp2": {
        "model.num_experts": 8,
        "model.top_k": 2,
        "model.moe_type": "Dropless",
        "model.mlp_ratio": 1.0,
        "parallel.mode": "fsdp2",
        "parallel.expert.size": 2,
        "memory_budget.expert_imbalance": 1.0,
    },
    "moe ep 2 x edp 2 x fsdp2": {
        "model.num_experts": 8,
        "model.top_k": 2,
        "model.moe_type": "Dropless",
        "model.mlp_ratio": 1.0,
        "parallel.mode": "fsdp2",
        "parallel.expert.size": 2,
        "memory_budget.expert_imbalance": 1.0,
    },
    # msp at tensor 2 with the sparse blocks whole on both tensor ranks (no_tp), each routing its sequence chunk;
    # expert 2 over all 4 ranks (the expert groups are the tensor groups), FSDP2 over "dp"
    "moe msp 2 x ep 2 x fsdp2": {
        "model.num_experts": 8,
        "model.top_k": 2,
        "model.moe_type": "Dropless",
        "model.mlp_ratio": 1.0,
        "parallel.mode": "fsdp2",
        "parallel.expert.size": 2,
        "parallel.tensor.size": 2,
        "parallel.tensor.mode": "msp",
        "parallel.expert.no_tp": True,
        "memory_budget.expert_imbalance": 1.0,
    },
}
# Settings measured on several processes (torchrun, gloo); the others run on one.
RANKS = {
    "fsdp2 x2": 2,
    "fsdp2 x4 + swap + ckpt 0.5": 4,
    "mtp 2": 2,
    "msp 2": 2,
    "fsp 2": 2,
    "isp 2": 2,
    "msp 2 x fsdp2 2 + offload 3": 4,
    "isp 2 x weight 2 + swap": 4,
    "fsp 4 over 2 kv heads": 4,
    "moe ep 2 x fsdp2": 2,
    "moe ep 2 x edp 2 x fsdp2": 4,
    "moe msp 2 x ep 2 x fsdp2": 4,
}
TOLERANCE = 0.05
Launcher = Callable[[list[str]], None]


def predict(config: Path, options: dict[str, Any], hardware: Hardware | None, world_size: int = 1) -> dict[str, Any]:
    """Rank 0's traced peaks, and with `hardware` the cost model's step time."""
    from internlm_offload.planner.trace import trace_step

    memory = trace_step(resolve_config(load_config_file(config, options), world_size=world_size), world_size)
    timing = step_time(memory.micro_batch_work, memory.optimizer_work, memory.micro_num, hardware) if hardware else None
    return {
        "device_peak_bytes": memory.device_peak_bytes,
        "first_step_device_peak_bytes": memory.first_step_device_peak_bytes,
        "host_peak_bytes": memory.host_peak_bytes,
        "predicted_step_time_s": timing.step_s if timing else None,
    }


def run_command(cmd: list[str]) -> None:
    """Run `cmd` in a new process; a failure raises (CalledProcessError)."""
    subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def measure(
    config: Path, options: dict[str, Any], steps: int, world_size: int = 1, launch: Launcher = run_command
) -> list[dict[str, Any]]:
    """The metrics record (rank 0's) of each step of a real `train.py` run on `world_size` processes (started by
    `launch`: the tests pass their own, which forks them from a process that has imported torch)."""
    launcher = (
        [sys.executable]
        if world_size == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}"]
    )
    with tempfile.TemporaryDirectory(prefix="planner-validation-") as work_dir:
        cmd = [
            *launcher,
            str(REPO / "train.py"),
            "--config",
            str(config),
            "--work-dir",
            work_dir,
            "--cfg-options",
            "monitor.progress_bar=off",
            "ckpt.enable_save_ckpt=False",
            f"data.total_steps={steps}",
            *option_strings(options),
        ]
        launch(cmd)
        records = (Path(work_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in records]


def validate(
    config: Path, name: str, steps: int, hardware: Hardware | None = None, launch: Launcher = run_command
) -> dict[str, Any]:
    """One setting: the prediction, the measured peaks and the relative error of the steady step; with
    `hardware`, the predicted and the measured (median of the steady steps) step time too."""
    options, world_size = SETTINGS[name], RANKS.get(name, 1)
    predicted = predict(config, options, hardware, world_size)
    records = measure(config, options, steps, world_size, launch)
    peaks = [r["device_peak_mem_bytes"] for r in records]
    measured = max(peaks[1:])  # the first step also creates the optimizer states
    error = predicted["device_peak_bytes"] / measured - 1
    return {
        "setting": name,
        "options": option_strings(options),
        "world_size": world_size,
        **predicted,
        "measured_step_peaks_bytes": peaks,
        "measured_bytes": measured,
        "error": error,
        "within_tolerance": abs(error) <= TOLERANCE,
        "measured_step_time_s": statistics.median(r["step_time_s"] for r in records[1:]),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| setting | predicted MiB | measured MiB | error | predicted step s | measured step s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        predicted_s = "" if row["predicted_step_time_s"] is None else f"{row['predicted_step_time_s']:.2f}"
        lines.append(
            f"| {row['setting']} | {row['device_peak_bytes'] / 2**20:.1f} | "
            f"{row['measured_bytes'] / 2**20:.1f} | {row['error']:+.1%} | "
            f"{predicted_s} | {row['measured_step_time_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["setting"] for row in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.bar([i - 0.2 for i in x], [row["device_peak_bytes"] / 2**20 for row in rows], width=0.4, label="predicted")
    ax.bar([i + 0.2 for i in x], [row["measured_bytes"] / 2**20 for row in rows], width=0.4, label="measured (cpu)")
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("device peak per step (MiB)")
    ax.set_title("Memory planner: predicted vs measured device peak")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=3, help="steps per measured run (>= 2)")
    parser.add_argument("--out", type=Path, default=REPO / "bench_results" / "planner")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: at least 2 (the first step creates the optimizer states)")
    args.out.mkdir(parents=True, exist_ok=True)
    hardware = calibrate()
    rows = []
    for name in args.settings:
        rows.append(validate(args.config, name, args.steps, hardware))
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    report = {"config": str(args.config), "hardware": asdict(hardware), "rows": rows}
    (args.out / "planner_validation.json").write_text(json.dumps(report, indent=2))
    (args.out / "planner_validation.md").write_text(markdown(rows))
    plot(rows, args.out / "planner_validation.png")
    print(markdown(rows))
    return 0 if all(row["within_tolerance"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
