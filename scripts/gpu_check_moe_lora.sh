#!/usr/bin/env bash
# Mixture-of-experts and LoRA on a real cuda device, in one pass (CI has no GPU; run this where one is lent):
#   1. the MoE composition e2e tests (activation offload, selective and full checkpointing, swap, hybrid,
#      gradient offload, NVMe, fp16 loss scaling: bitwise against the MoE baseline) and the LoRA checkpoint and
#      resume e2e tests, on cuda under PyTorch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1), with the general
#      offload-vs-baseline e2e test beside them;
#   2. one profiled step of the tiny MoE config with three of its four blocks offloaded, and how much of its
#      copying overlaps kernels (tools.trace_overlap).
# Usage: scripts/gpu_check_moe_lora.sh OUT_DIR   (writes csan_e2e.log, moe_trace.json.gz, moe_overlap.json, run.log)
# The grouped GEMM runs as torch's cuda kernel here (on cpu, its reference path); the multi-process tests stay
# on cpu (one GPU cannot hold two NCCL ranks).
source "$(dirname "$0")/gpu_common.sh"

log "1. MoE composition, LoRA and offload e2e tests on cuda under the sanitizer"
TORCH_CUDA_SANITIZER=1 timeout "${CSAN_TIMEOUT:-330}" $py -m pytest -q -p no:cacheprovider -n 8 --dist load \
    tests/e2e/test_moe_composition_e2e.py tests/e2e/test_lora_e2e.py tests/e2e/test_offload_e2e.py \
    -k "fp32_gshard or bf16_dropless or fp16_loss or checkpoints_hold or resume_loads or (align_bitwise and none)" \
    >"$out/csan_e2e.log" 2>&1
log "sanitizer e2e exit $? ($(tail -1 "$out/csan_e2e.log"))"

log "2. one profiled MoE step, three of its four blocks offloaded (step 4)"
rm -rf /tmp/gpu_check_moe
timeout 120 $py train.py --config configs/internlm2_tiny_moe.py --work-dir /tmp/gpu_check_moe --cfg-options \
    cpu_offloading.enable=True cpu_offloading.num_layers=3 data.total_steps=4 monitor.profile_step=4 \
    ckpt.enable_save_ckpt=False monitor.progress_bar=off >>"$out/run.log" 2>&1 || log "profiled run failed ($?)"
cp /tmp/gpu_check_moe/profile/step4_rank0.json.gz "$out/moe_trace.json.gz"
$py -m internlm_offload.tools.trace_overlap "$out/moe_trace.json.gz" | tee "$out/moe_overlap.json"
log "done"
