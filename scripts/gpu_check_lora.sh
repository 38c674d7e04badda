#!/usr/bin/env bash
# LoRA's base on the host, QLoRA and the reworked activation offload on a real cuda device, in one pass (CI has no
# GPU; run this where one is lent):
#   1. tiny runs on cuda under PyTorch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1, which fails a run on any
#      unsynchronized access across streams), all at once: LoRA with the base on the host (alone, with
#      activation offload, with checkpointing), QLoRA's 4-bit base (bitsandbytes' cuda kernels) on the device and
#      on the host, activation offload, and the everything-offloaded config less its selective offload; each
#      variant's loss and grad norm compared bitwise (tools.loss_compare) with its baseline's;
#   2. step times of a mid-size bf16 LoRA model, the base on the device against the base on the host (alternated,
#      two rounds), and the same with QLoRA's base;
#   3. one profiled step of the mid-size LoRA model with its base on the host, and how much of its copying
#      overlaps kernels (tools.trace_overlap);
#   4. the build's device peak of that model with its base on the host, built on meta against built whole first.
# STAGES picks stages (default 1234).
# Usage: scripts/gpu_check_lora.sh OUT_DIR   (writes csan.log, compare.log, timing.json, lora_trace.json.gz,
# lora_overlap.json, run.log). Needs bitsandbytes with its cuda library; PYTHON picks the interpreter; CSAN=0 runs
# stage 1 without the sanitizer (a dry run of the script on a cpu machine, where the sanitizer cannot start).
source "$(dirname "$0")/gpu_common.sh"
work=/tmp/gpu_check_lora
rm -rf "$work"
common=(ckpt.enable_save_ckpt=False monitor.progress_bar=off)

train() {  # train NAME CONFIG [options...]: one run into $work/NAME, its output appended to LOG (default run.log)
    local name=$1 config=$2
    shift 2
    timeout "${RUN_TIMEOUT:-200}" $py train.py --config "configs/$config" --work-dir "$work/$name" \
        --cfg-options "${common[@]}" "$@" >>"${LOG:-$out/run.log}" 2>&1 || log "$name failed ($?)"
}

train_ddp() {  # train_ddp NAME PORT CONFIG [options...]: `train` as one torchrun process under DDP (nccl on cuda)
    local name=$1 port=$2 config=$3
    shift 3
    timeout "${RUN_TIMEOUT:-200}" $py -m torch.distributed.run --nproc-per-node 1 --master-port "$port" train.py \
        --config "configs/$config" --work-dir "$work/$name" --cfg-options "${common[@]}" parallel.mode=ddp "$@" \
        >>"${LOG:-$out/run.log}" 2>&1 || log "$name failed ($?)"
}

stages=${STAGES:-1234}
host=model.lora.base_on_host=True
offload=(cpu_offloading.enable=True cpu_offloading.num_layers=3)
moe="model.lora.r=4 model.lora.lora_alpha=8 model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,\
down_proj] model.dtype=torch.bfloat16"
declare -A runs=(
    [lora]="internlm2_tiny_lora.py"
    [lora_host]="internlm2_tiny_lora.py $host"
    [lora_host_offload]="internlm2_tiny_lora.py $host ${offload[*]}"
    [lora_host_ckpt]="internlm2_tiny_lora.py $host model.checkpoint=1.0"
    [qlora]="internlm2_tiny_qlora.py"
    [qlora_host]="internlm2_tiny_qlora.py $host"
    [dense]="internlm2_tiny.py"
    [dense_offload]="internlm2_tiny_act_offload.py"
    # without the selective offload, whose stores the sanitizer reports falsely (docs/benchmarks.md, "MoE and LoRA")
    [dense_all]="internlm2_tiny_all_offload.py selective_checkpoint_offload=False"
    # a mixture of experts' stacked experts on the host (their backward recomputes them), transformers' Llama
    [moe_lora]="internlm2_tiny_moe.py $moe"
    [moe_lora_host]="internlm2_tiny_moe.py $moe $host"
    [moe_lora_host_ckpt]="internlm2_tiny_moe.py $moe $host model.checkpoint=1.0"
    [hf_lora]="hf_llama_tiny_lora.py"
    [hf_lora_host]="hf_llama_tiny_lora.py $host"
)
pairs=(lora:lora_host lora:lora_host_offload lora:lora_host_ckpt qlora:qlora_host dense:dense_offload dense:dense_all
    moe_lora:moe_lora_host moe_lora:moe_lora_host_ckpt hf_lora:hf_lora_host ddp_lora:ddp_lora_host)
if [[ $stages == *1* ]]; then
    log "1. tiny runs under the sanitizer (CSAN=${CSAN:-1}), in parallel"
    (
        # torch enables the sanitizer when the variable is set at all, to any value
        [[ ${CSAN:-1} == 0 ]] || export TORCH_CUDA_SANITIZER=1
        for name in "${!runs[@]}"; do
            read -ra args <<<"${runs[$name]}"
            LOG="$out/csan_$name.log" train "$name" "${args[@]}" data.total_steps=4 &
        done
        # DDP with the base drawn into host memory: the wrapper leaves those weights out (one device type)
        LOG="$out/csan_ddp_lora.log" train_ddp ddp_lora 29711 internlm2_tiny_lora.py data.total_steps=4 &
        LOG="$out/csan_ddp_lora_host.log" train_ddp ddp_lora_host 29712 internlm2_tiny_lora.py $host data.total_steps=4 &
        wait
    )
    for log_file in "$out"/csan_*.log; do  # one log: the sanitizer's report names the two accesses and their stacks
        echo "===== $(basename "$log_file" .log)" >>"$out/csan.log"
        tail -c 6000 "$log_file" >>"$out/csan.log"
        rm "$log_file"
    done
    for pair in "${pairs[@]}"; do
        for metric in loss grad_norm; do
            echo "===== $pair $metric" >>"$out/compare.log"
            $py -m internlm_offload.tools.loss_compare "$work/${pair%%:*}" "$work/${pair#*:}" --metric $metric \
                --quiet >>"$out/compare.log" 2>&1
            log "compare $pair $metric: exit $?"
        done
    done
fi

read -ra mid <<<"${GPU_CHECK_SIZE:-model.num_layers=12 model.hidden_size=2048 model.num_attention_heads=16 \
model.num_kv_attention_heads=8 data.seq_len=2048 data.micro_bsz=4 data.micro_num=2}"
if [[ $stages == *2* ]]; then
log "2. step times (${mid[*]})"
for round in 1 2; do
    train "mid_lora_$round" internlm2_tiny_lora.py "${mid[@]}" data.total_steps=8
    train "mid_host_$round" internlm2_tiny_lora.py "${mid[@]}" data.total_steps=8 $host
    train "mid_qlora_$round" internlm2_tiny_qlora.py "${mid[@]}" data.total_steps=8
    train "mid_qhost_$round" internlm2_tiny_qlora.py "${mid[@]}" data.total_steps=8 $host
done
$py - "$out/timing.json" "$work" <<'EOF' | tee -a "$out/run.log"
import json, statistics, sys
from pathlib import Path
result, work = {}, Path(sys.argv[2])
for name in ("lora", "host", "qlora", "qhost"):
    times, peaks, copies = [], [], []
    for round_ in (1, 2):
        path = work / f"mid_{name}_{round_}" / "metrics.jsonl"
        if path.exists():
            records = [json.loads(line) for line in path.read_text().splitlines()][3:]  # past warm-up
            times += [r["step_time_s"] for r in records]
            peaks += [r["device_peak_mem_bytes"] for r in records]
            copies += [r.get("base_on_host_copy_s", 0.0) for r in records]
    if times:
        result[name] = {"median_step_s": statistics.median(times), "steps": len(times),
                        "device_peak_gib": max(peaks) / 2**30, "median_base_copy_s": statistics.median(copies)}
for name, base in (("host", "lora"), ("qlora", "lora"), ("qhost", "qlora")):
    if name in result and base in result:
        result[name][f"time_vs_{base}"] = round(result[name]["median_step_s"] / result[base]["median_step_s"], 3)
Path(sys.argv[1]).write_text(json.dumps(result, indent=2))
print(json.dumps(result, indent=2))
EOF
fi

if [[ $stages == *3* ]]; then
    log "3. one profiled step of the mid-size LoRA model, its base on the host (step 4)"
    train profiled internlm2_tiny_lora.py "${mid[@]}" data.total_steps=4 monitor.profile_step=4 $host
    cp "$work/profiled/profile/step4_rank0.json.gz" "$out/lora_trace.json.gz"
    $py -m internlm_offload.tools.trace_overlap "$out/lora_trace.json.gz" | tee "$out/lora_overlap.json"
fi
if [[ $stages == *4* ]]; then
    log "4. the build's device peak of the mid-size LoRA model, base on the host: built on meta, and whole first"
    for meta in True False; do
        LOG="$out/build_$meta.log" train "build_$meta" internlm2_tiny_lora.py "${mid[@]}" data.total_steps=1 $host \
            parallel.meta_init=$meta
        log "meta_init=$meta: $(grep -o 'Model built: .*' "$out/build_$meta.log")"
        rm "$out/build_$meta.log"
    done
fi
log "done"
