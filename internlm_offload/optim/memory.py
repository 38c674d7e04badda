"""Host-memory preflight for optimizer offload: refuse a run whose host states cannot fit."""

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from internlm_offload.log import get_logger
from internlm_offload.optim.rules import UpdateRule, rule_for

logger = get_logger(__name__)

# Hybrid CPU side, besides the rule's states: the fp32 master param and its grad buffer.
HYBRID_MASTER_AND_GRAD_BYTES = 8


def state_bytes_per_element(rule: UpdateRule, hyper: Mapping[str, Any]) -> int:
    """Host (or disk) bytes per trainable element the swap tier keeps: the rule's fp32 states (AdamW: 8, 12 with
    amsgrad)."""
    return rule.state_bytes(torch.float32, hyper)


def hybrid_bytes_per_element(rule: UpdateRule, hyper: Mapping[str, Any]) -> int:
    """Host bytes per CPU-stepped element of the hybrid optimizer: master, grad buffer and states (AdamW: 16)."""
    return HYBRID_MASTER_AND_GRAD_BYTES + state_bytes_per_element(rule, hyper)


def groups_state_bytes(
    groups: Sequence[Mapping[str, Any]], default: UpdateRule, named: Mapping[str, UpdateRule]
) -> tuple[int, int]:
    """(trainable elements, bytes of their fp32 states) of the params `groups` step, each with its group's rule's
    bytes (Muon's 4 per element beside AdamW's 8): this process's shards under FSDP2."""
    elements = states = 0
    for group in groups:
        count = sum(_local(p).numel() for p in group["params"] if p.requires_grad)
        elements += count
        states += count * state_bytes_per_element(rule_for(group, default, named), group)
    return elements, states


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


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
