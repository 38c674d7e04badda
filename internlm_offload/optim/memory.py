"""Host-memory preflight for optimizer offload: refuse a run whose host states cannot fit."""

import torch.nn as nn

from internlm_offload.log import get_logger

logger = get_logger(__name__)

# Host bytes per trainable parameter element (fp32 states: exp_avg + exp_avg_sq [+ max_exp_avg_sq]).
SWAP_STATE_BYTES = 8
SWAP_STATE_BYTES_AMSGRAD = 12
# Hybrid CPU side: fp32 master param + grad buffer + exp_avg + exp_avg_sq.
HYBRID_CPU_BYTES = 16


class HostMemoryError(RuntimeError):
    """The host cannot hold what the chosen optimizer offload would put there."""


def trainable_elements(model: nn.Module) -> int:
    """Elements of this process's trainable params (its shards under FSDP2)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters() if p.requires_grad)


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (0 when unknown)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def check_host_memory(required: int, what: str, *, available: int | None = None, world_local: int = 1) -> None:
    """Refuse when `world_local` processes on this host each need `required` bytes that are not there."""
    available = available_host_bytes() if available is None else available
    need = required * world_local
    logger.info(
        "%s needs %.1f MB of host memory per process (%.1f MB available)", what, required / 2**20, available / 2**20
    )
    if available and need > available:
        raise HostMemoryError(
            f"{what} needs {need / 2**30:.2f} GiB of host memory on this machine ({world_local} process(es) x "
            f"{required / 2**30:.2f} GiB) but only {available / 2**30:.2f} GiB is available; "
            "use fewer processes per host, a smaller model, or turn the optimizer offload off"
        )
