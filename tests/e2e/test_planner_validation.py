"""The planner's predicted device peak against a measured `train.py` run on cpu (docs/planner.md).

One of the benchmark's settings, on its 12-block validation model (at a shorter sequence: `SEQ_LEN`): the
one with every feature (activation offload, checkpointing with selective offload, swap optimizer with its host
arena), and FSDP2 on two processes (torchrun, gloo: rank 0's measured peak against its trace over the fake process group), fsp at T=2
on two processes and isp 2 x weight 2 with the swap optimizer on four (the trace over a fake ("dp", "tp") mesh),
and a mixture of experts (8 stacked experts through cpu's grouped GEMM, top-2 Dropless, a shared expert, 3 blocks
offloaded; its trace on meta runs every row through one expert's weights, of the same shapes), and LoRA r=8 over a
frozen bf16 base (docs/lora.md's 26 M-parameter shape, its own sequence and micro-batch: -0.9 %; -8.0 % with the
kernel probe's block built without the adapters), and expert parallel at EP=2 on two processes (4 of 8 experts
per rank, the all-to-all's buffers at `memory_budget.expert_imbalance=1.0`: +2.1 %; proven red with rank 0's
receive buffer sized for every row of both ranks: +17.5 %), and the DeepSeek-V3 lineage (model.type="deepseek_v3": MLA,
2 dense-first blocks before 4 sparse ones of the bias router, half of them recomputed: -1.6 %; -8.0 % with the kernel
probe skipped for a family without a one-block copy, as it was until the family named its blocks' kinds), and Qwen3-Next (model.type="qwen3_next": 6 Gated DeltaNet blocks and 2 gated attention ones, 8
experts beside the gated shared expert, half of them recomputed: -1.9 %; -3.8 % before the family named its blocks' kinds);
`tests/e2e/test_memory_budget.py` measures another (the planner's choice), and
`python -m internlm_offload.bench.planner` runs them all. Gradient offload's two rows (with and without it). And `make train`'s own memory line, within the
planner's documented 3 %.
"""

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from runner import TINY, metrics, run_python, train

from internlm_offload.bench.planner import CONFIG, SETTINGS, TOLERANCE, validate
from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.planner.trace import trace_step

pytestmark = pytest.mark.e2e


# The validation model at a shorter sequence (12 blocks, hidden 512, micro-batch 4 as in
# configs/planner_validation.py): the same runs of blocks, parameters, masters, states and gradients, a quarter (or
# half) of the activations and of the compute (CI time). Each row's error at sequence 128: all -0.3 %, fsp 2 -0.7 %,
# moe -0.2 %, gradient offload's two rows -0.6 % and -1.4 % (the full shape's are in docs/planner.md and
# docs/parallelism.md). isp 2 x weight 2 + swap runs at 256: what its trace misses grows as the sequence shrinks
# (2.9, 6.1 and 8.7 MiB at 512, 256 and 128: -0.5 %, -1.7 % and -3.6 %), and 128 is too near the bar.
SEQ_LEN = {"isp 2 x weight 2 + swap": 256}


@pytest.fixture(scope="module")
def short_config(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`config(setting)`: the validation model at the setting's sequence (`SEQ_LEN`, else 128)."""
    folder = tmp_path_factory.mktemp("planner_validation")

    def config(setting: str) -> Path:
        seq_len = SEQ_LEN.get(setting, 128)
        path = folder / f"planner_validation_seq{seq_len}.py"
        path.write_text(f"_base_ = [{str(CONFIG)!r}]\ndata = dict(seq_len={seq_len})\n")
        return path

    return config


def forked(cmd: list[str]) -> None:
    """The benchmark's measured run, forked like the suite's other runs (runner.run_python), one thread each:
    two threads beside the other test worker's processes on two cores wait on each other (gradient offload's
    rows took 165 s so in CI). The peaks are the same to 0.1 %."""
    proc = run_python(cmd, expect_success=True)
    assert proc.returncode == 0, proc.stderr[-4000:]


# FSDP2 alone ("fsdp2 x2") and the other tensor layouts: bench/planner.py, docs/planner.md, docs/parallelism.md
@pytest.mark.parametrize(
    "setting",
    [
        "all",
        "fsp 2",
        "isp 2 x weight 2 + swap",
        "moe 8 x top-2 dropless + offload 3",
        "lora r=8 bf16",
        "moe ep 2 x fsdp2",
        "deepseek mla 2 dense + 4 sparse + ckpt 0.5",
        "glm5 dsa top-64 + ckpt 0.5",
        "qwen3_next 6 deltanet + 2 attention + ckpt 0.5",
    ],
)
def test_predicted_device_peak_is_within_5_percent_of_measured(
    setting: str, short_config: Callable[[str], Path]
) -> None:
    row = validate(short_config(setting), setting, steps=2, launch=forked)
    assert abs(row["error"]) <= TOLERANCE, (
        f"{setting}: predicted {row['device_peak_bytes']} B, measured {row['measured_bytes']} B "
        f"(steps {row['measured_step_peaks_bytes']}): {row['error']:+.1%}"
    )


def test_gradient_offload_lowers_the_measured_peak_by_the_fp32_gradient_buffer(
    short_config: Callable[[str], Path],
) -> None:
    """bf16 with fp32 masters, checkpoint 1.0, hybrid 1.0, two micro-batches (the fp32 gradient buffer is part
    of the peak, as at 7B): with gradient offload the measured device peak is within 5 % of the planner's and
    lower than without it by at least the fp32 buffer the device no longer holds."""
    config = short_config("bf16 ckpt 1.0 + hybrid 1.0")
    without = validate(config, "bf16 ckpt 1.0 + hybrid 1.0", steps=2, launch=forked)
    offloaded = validate(config, "bf16 ckpt 1.0 + hybrid 1.0 + grad offload", steps=2, launch=forked)
    assert abs(offloaded["error"]) <= TOLERANCE, offloaded
    bf16_params = trace_step(resolve_config(load_config_file(config, SETTINGS["bf16 ckpt 1.0 + hybrid 1.0"])))
    fp32_gradients = 2 * bf16_params.components["model_params"]
    assert without["measured_bytes"] - offloaded["measured_bytes"] >= fp32_gradients, (without, offloaded)


@pytest.mark.parametrize("config", [TINY, TINY.with_name("internlm2_tiny_muon.py")], ids=["adamw", "muon"])
def test_make_trains_memory_line_is_within_the_documented_3_percent(tmp_path, config: Path) -> None:
    """`make train`'s config as shipped (no FAST shapes): the memory line a newcomer reads first. The
    runtime's own memory is measured at start-up and kept out of both figures (it read -29 % with it in). Its Muon
    twin (configs/internlm2_tiny_muon.py): +0.3 %; -14.6 % before the kernel probe ran Newton-Schulz at the Muon
    matrices' shapes (oneDNN's bf16 matmul caches, ~2 MiB per shape, in the step readings)."""
    proc = train(tmp_path, "data.total_steps=3", "ckpt.enable_save_ckpt=False", config=config, fast=False)
    line = re.search(r"Memory: device peak of steps 2-3 measured ([\d.]+) MiB, predicted ([\d.]+) MiB", proc.stderr)
    assert line is not None, proc.stderr[-2000:]
    measured, predicted = float(line[1]), float(line[2])
    assert abs(predicted / measured - 1) <= 0.03, line[0]
    assert re.search(r"Runtime memory: the kernels keep [\d.]+ MiB", proc.stderr)
    peak = max(record["device_peak_mem_bytes"] for record in metrics(tmp_path)[1:3]) / 2**20
    assert abs(peak - measured) < 0.1  # the line reads the figures metrics.jsonl records
