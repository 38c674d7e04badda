#!/usr/bin/env bash
# flash-linear-attention's gated delta rule on a real cuda device, against the torch chunked rule (CI has no GPU;
# run this where one is lent, with `flash-linear-attention` installed beforehand: the device machine has no index):
# bench.fla_kernels, output and gradient errors against the torch path, forward + backward times alternated,
#      at 4k and 16k tokens in bf16 and 4k in fp32.
# Usage: scripts/gpu_check_fla.sh OUT_DIR   (writes fla_bf16.json, fla_fp32.json, run.log); ~2 minutes;
# it exits 1 where the kernels disagree past the bench's TOLERANCE.
source "$(dirname "$0")/gpu_common.sh"

if ! $py -c "import fla.ops.gated_delta_rule" 2>>"$out/run.log"; then
    log "flash-linear-attention is not importable: pip install flash-linear-attention first"
    exit 2
fi
log "bench.fla_kernels"
$py -m internlm_offload.bench.fla_kernels --seqs 4096 16384 --dtype bfloat16 --out "$out/fla_bf16.json" \
    2>&1 | tee -a "$out/run.log"
$py -m internlm_offload.bench.fla_kernels --seqs 4096 --dtype float32 --out "$out/fla_fp32.json" \
    2>&1 | tee -a "$out/run.log"
log "done"
