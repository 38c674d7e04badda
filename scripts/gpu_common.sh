# Sourced by the scripts/gpu_check*.sh scripts: their output folder (the first argument), the python to run,
# a timestamped log line (also kept in OUT_DIR/run.log), and the torch build and device first in that log.
set -uo pipefail
out=${1:?usage: $0 OUT_DIR}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
log() { echo "== $(date +%T) $*" | tee -a "$out/run.log"; }

log "$($py -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no cuda")')"
