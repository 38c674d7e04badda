"""Accelerator layer: the one place that talks to `torch.cuda` / `torch.npu`.

Trainer, offload and optimizer code ask an `Accelerator` for devices, process-group backends, host
buffers and memory statistics, so the same code runs on cuda, npu (through `torch_npu`) and cpu.
On cpu, "device memory" is the process's resident set (RSS) and its peak, read from /proc.
"""

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


@dataclass(frozen=True)
class Accelerator:
    """A device type plus the torch module that drives it (`torch.cuda`, `torch.npu`, or none for cpu)."""

    name: str  # "cuda" | "npu" | "cpu"

    @property
    def module(self) -> Any:
        """`torch.cuda` / `torch.npu`; None on cpu."""
        return None if self.name == "cpu" else getattr(torch, self.name)

    @property
    def dist_backend(self) -> str:
        return BACKENDS[self.name]

    @property
    def supports_pinned_memory(self) -> bool:
        # Pinning needs a driver; torch raises on a machine without one.
        return self.name != "cpu"

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu") if self.name == "cpu" else torch.device(self.name, local_rank)

    def set_device(self, local_rank: int) -> None:
        if self.module is not None:
            self.module.set_device(local_rank)

    def synchronize(self) -> None:
        if self.module is not None:
            self.module.synchronize()

    def manual_seed_all(self, seed: int) -> None:
        if self.module is not None:
            self.module.manual_seed_all(seed)

    def rng_state(self) -> torch.Tensor | None:
        return None if self.module is None else self.module.get_rng_state()

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        if self.module is not None and state is not None:
            self.module.set_rng_state(state)

    def host_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, pinned: bool = True) -> torch.Tensor:
        """A host buffer, page-locked when asked for and the device supports it."""
        return torch.empty(shape, dtype=dtype, pin_memory=pinned and self.supports_pinned_memory)

    def memory_allocated(self) -> int:
        """Bytes held on the device now (cpu: process RSS)."""
        if self.module is None:
            return _proc_status_kib("VmRSS") * 1024
        return int(self.module.memory_allocated())

    def max_memory_allocated(self) -> int:
        """Peak bytes held on the device since the last reset (cpu: peak RSS)."""
        if self.module is None:
            return _proc_status_kib("VmHWM") * 1024
        return int(self.module.max_memory_allocated())

    def reset_peak_memory_stats(self) -> None:
        if self.module is None:
            _reset_peak_rss()
        else:
            self.module.reset_peak_memory_stats()


def get_accelerator(name: str = "auto") -> Accelerator:
    """Pick the accelerator: `auto` prefers cuda, then npu, then cpu; a named one must be available."""
    if name == "auto":
        for candidate in ("cuda", "npu"):
            if is_available(candidate):
                return Accelerator(candidate)
        return Accelerator("cpu")
    if not is_available(name):
        raise ValueError(f"device={name!r} is not available on this machine; use 'auto' or 'cpu'")
    return Accelerator(name)


def is_available(name: str) -> bool:
    if name == "cpu":
        return True
    if name == "npu" and importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  registers torch.npu

    module = getattr(torch, name, None)
    return module is not None and module.is_available()


def host_rss_bytes() -> int:
    """Resident host memory of this process (independent of the accelerator)."""
    return _proc_status_kib("VmRSS") * 1024


def _proc_status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reset_peak_rss() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass
