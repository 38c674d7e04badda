#!/usr/bin/env bash
# The offload paths on a real cuda device, in one pass (CI has no GPU; run this where one is lent):
#   1. the offload-vs-baseline e2e tests (bitwise loss and grad norm on cuda) under PyTorch's CUDA
#      sanitizer (TORCH_CUDA_SANITIZER=1), which fails a run on any unsynchronized access across streams;
#      the offload/optimizer unit tests beside them;
#   2. step times of a mid-size model, baseline against the offload configs (interleaved, two rounds);
#   3. one profiled step of the everything-offloaded config and how much of its copying overlaps kernels.
# Usage: scripts/gpu_check.sh OUT_DIR   (writes unit.log, csan_e2e.log, timing.json, trace.json.gz, overlap.json, run.log)
# About 6-7 minutes on an H200; the e2e stage alone needs ~4 (seven train.py runs under the sanitizer in one test).
# The sanitizer prints each race (the two accesses, their streams and stacks) to stderr before it raises; the
# e2e runner keeps only the last 4000 characters of a failing run's stderr, so rerun that config by hand to read it.
source "$(dirname "$0")/gpu_common.sh"

log "1. offload e2e tests on cuda under the sanitizer; beside them the offload/optimizer unit tests (cpu, no sanitizer)"
# The unit tests run on the cpu accelerator, where the sanitizer checks nothing; its global dispatch mode
# would only get in the way of the tests' own dispatch modes (op counters, the selective replay).
timeout "${UNIT_TIMEOUT:-200}" $py -m pytest -q -p no:cacheprovider -n 8 --dist load \
    tests/unit/test_activation_offload.py tests/unit/test_selective_offload.py tests/unit/test_swap_optimizer.py \
    tests/unit/test_hybrid_optimizer.py tests/unit/test_grad_offload.py tests/unit/test_copy_lane.py \
    tests/unit/test_ordering.py >"$out/unit.log" 2>&1 &
unit=$!
TORCH_CUDA_SANITIZER=1 timeout "${CSAN_TIMEOUT:-300}" $py -m pytest -q -p no:cacheprovider -n 8 --dist load \
    tests/e2e/test_offload_e2e.py -k "none or catches" >"$out/csan_e2e.log" 2>&1
log "sanitizer e2e exit $? ($(tail -1 "$out/csan_e2e.log"))"
wait $unit
log "unit exit $? ($(tail -1 "$out/unit.log"))"

# A mid-size bf16 model: big enough that copies and kernels take visible time on a GPU.
read -ra mid <<<"${GPU_CHECK_SIZE:-model.num_layers=12 model.hidden_size=2048 model.num_attention_heads=16 \
model.num_kv_attention_heads=8 model.dtype=torch.bfloat16 data.seq_len=2048 data.micro_bsz=2 data.micro_num=2}"
mid+=(ckpt.enable_save_ckpt=False monitor.progress_bar=off)
run() {  # run NAME CONFIG STEPS [options...]
    local name=$1 config=$2 steps=$3
    shift 3
    timeout 120 $py train.py --config "configs/$config" --work-dir "/tmp/gpu_check/$name" \
        --cfg-options "${mid[@]}" data.total_steps="$steps" "$@" >>"$out/run.log" 2>&1 || log "$name failed ($?)"
}

log "2. step times (${mid[*]})"
rm -rf /tmp/gpu_check
for round in 1 2; do
    run "base_$round" internlm2_tiny.py 6
    run "act_$round" internlm2_tiny_act_offload.py 6 cpu_offloading.num_layers=6
    run "swap_$round" internlm2_tiny_swap.py 6 use_pinned_optimizer_offload=True
    run "all_$round" internlm2_tiny_all_offload.py 6 cpu_offloading.num_layers=6
done
$py - "$out/timing.json" <<'EOF' | tee -a "$out/run.log"
import json, statistics, sys
from pathlib import Path
result = {}
for name in ("base", "act", "swap", "all"):
    times, peaks = [], []
    for round_ in (1, 2):
        path = Path(f"/tmp/gpu_check/{name}_{round_}/metrics.jsonl")
        if path.exists():
            records = [json.loads(line) for line in path.read_text().splitlines()][3:]  # past warm-up
            times += [r["step_time_s"] for r in records]
            peaks += [r["device_peak_mem_bytes"] for r in records]
    if times:
        result[name] = {"median_step_s": statistics.median(times), "steps": len(times), "device_peak_gib": max(peaks) / 2**30}
base = result.get("base", {}).get("median_step_s")
for name, row in result.items():
    row["time_vs_base"] = round(row["median_step_s"] / base, 3) if base else None
Path(sys.argv[1]).write_text(json.dumps(result, indent=2))
print(json.dumps(result, indent=2))
EOF

log "3. one profiled step (all offload, step 4)"
run profiled internlm2_tiny_all_offload.py 4 cpu_offloading.num_layers=6 monitor.profile_step=4
cp /tmp/gpu_check/profiled/profile/step4_rank0.json.gz "$out/trace.json.gz"
$py -m internlm_offload.tools.trace_overlap "$out/trace.json.gz" | tee "$out/overlap.json"
log "done"
