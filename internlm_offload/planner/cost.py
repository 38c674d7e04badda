"""Step time from the traced step's work and a machine's throughputs: a stated model, not a measurement.

The trace counts, per micro-batch and per optimizer step: matmul and attention FLOPs (torch's
`FlopCounterMode`, recomputation included), bytes copied between host and device (every `copy_`
whose source and destination lie in different tiers), bytes that additions into host tensors read and
write (gradient offload's accumulation), and AdamW elements stepped on the device and on the host.
`step_time` turns them into seconds with a `Hardware` row:

    micro-batch = max(FLOPs / flops_per_s, copies / link_bytes_per_s,   activation and gradient copies
                      host adds / host_bytes_per_s)                      and the host's adds overlap compute
    optimizer   = max(device elements x 28 B / hbm_bytes_per_s,          the hybrid's CPU share overlaps
                      host elements / cpu_adam_elements_per_s)           the device step
                  + max(step copies / link_bytes_per_s,                  swap and hybrid traffic, not hidden;
                        disk bytes / disk_bytes_per_s)                   NVMe reads and writes overlap it
    step        = micro_num x micro-batch + optimizer

The host's memory bandwidth is the one the CPU AdamW rate assumes (`host_bytes_per_s`: elements/s x 28 B).
Ranks on one node share it (`shared_by`): each gets its share for host adds and the CPU AdamW step, and
its device's link is capped at that share; a row describes one device and the node's host.
Rows for common accelerators are assumptions (their sources say so, and the planner prints them);
`calibrate()` measures this machine's rows instead (cpu: matmul, memcpy, fused AdamW).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from internlm_offload.planner.tracker import StorageTracker, copies_meta_to_cpu

ADAMW_BYTES_PER_ELEMENT = 28  # read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq (fp32)
ADAMW_OPS = ("aten._fused_adamw_.default", "aten._fused_adam_.default")
ADD_OPS = ("aten.add_.Tensor", "aten.add.out")


@dataclass(frozen=True)
class Hardware:
    """Throughputs one step time is computed with; `source` says whether they are assumed or measured."""

    name: str
    flops_per_s: float  # achieved dense matmul throughput in the compute dtype
    link_bytes_per_s: float  # host <-> device copies, per direction, pinned host memory
    hbm_bytes_per_s: float  # device memory bandwidth (the device AdamW step is bound by it)
    cpu_adam_elements_per_s: float  # AdamW elements per second on the host, all cores
    source: str
    # The NVMe tier's bandwidth per node (reads and writes together); no row measures it, so it is stated.
    disk_bytes_per_s: float = 6e9
    disk_source: str = "assumed: one NVMe drive per node, ~6 GB/s (PCIe 4.0 x4)"


HARDWARE = {
    "h100": Hardware("H100 SXM 80GB", 400e12, 50e9, 2.7e12, 3e9,
                     "assumed: 40% MFU of 989 TFLOP/s dense bf16; PCIe 5.0 x16 ~50 GB/s; 80% of 3.35 TB/s HBM3; "
                     "host fused AdamW 3e9 elem/s (~100 GB/s DRAM at 28 B/elem)"),
    "a100": Hardware("A100 SXM 80GB", 125e12, 25e9, 1.6e12, 3e9,
                     "assumed: 40% MFU of 312 TFLOP/s dense bf16; PCIe 4.0 x16 ~25 GB/s; 80% of 2.0 TB/s HBM2e; "
                     "host fused AdamW 3e9 elem/s"),
    "910b": Hardware("Ascend 910B", 125e12, 25e9, 1.3e12, 3e9,
                     "assumed: 40% of ~313 TFLOP/s fp16/bf16; PCIe 4.0 x16 ~25 GB/s; 80% of 1.6 TB/s HBM; "
                     "host fused AdamW 3e9 elem/s"),
}  # fmt: skip


@dataclass
class StepWork:
    """What one traced phase did: FLOPs, host<->device bytes and AdamW elements per tier."""

    flops: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    device_adamw_elements: int = 0
    host_adamw_elements: int = 0
    host_add_bytes: int = 0  # read and written by additions into host tensors (gradient offload's accumulation)
    disk_bytes: int = 0  # read from and written to the NVMe tier (copies from and to its mapped file)

    def scaled(self, factor: float) -> StepWork:
        return StepWork(**{k: int(v * factor) for k, v in asdict(self).items()})

    def __add__(self, other: StepWork) -> StepWork:
        return StepWork(**{k: v + getattr(other, k) for k, v in asdict(self).items()})

    def __sub__(self, other: StepWork) -> StepWork:
        return self + other.scaled(-1)


@dataclass(eq=False)
class WorkCounter(TorchDispatchMode):
    """Counts copies between tiers and AdamW elements while active (tiers from the tracker)."""

    tracker: StorageTracker
    work: StepWork = field(default_factory=StepWork)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = str(func)
        if name == "aten.copy_.default":
            self._count_copy(args[0], args[1])
        elif copies_meta_to_cpu(func, args, kwargs):  # FSDP2's CPU offload policy moving a gradient shard
            self.work.d2h_bytes += args[0].numel() * args[0].element_size()
        elif name in ADD_OPS:
            self._count_add(args, kwargs or {})
        elif name in ADAMW_OPS:
            params = args[0]
            elements = sum(p.numel() for p in params)
            if params and self.tracker.tier_of(params[0]) == "host":
                self.work.host_adamw_elements += elements
            else:
                self.work.device_adamw_elements += elements
        return func(*args, **(kwargs or {}))

    def _count_add(self, args: tuple, kwargs: dict) -> None:
        """An addition into a host tensor: it reads and writes the result, and reads the added tensor."""
        out = kwargs.get("out", args[0])
        if self.tracker.tier_of(out) != "host":
            return
        added = [a for a in args if torch.is_tensor(a) and a is not out]
        self.work.host_add_bytes += 2 * out.numel() * out.element_size() + sum(
            a.numel() * a.element_size() for a in added
        )

    def _count_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        tiers = (self.tracker.tier_of(src) or "device", self.tracker.tier_of(dst) or "device")
        nbytes = dst.numel() * dst.element_size()
        if "disk" in tiers:  # through the page cache: a disk transfer and a host one
            self.work.disk_bytes += nbytes
            tiers = tuple("host" if tier == "disk" else tier for tier in tiers)
        if tiers == ("host", "device"):
            self.work.h2d_bytes += nbytes
        elif tiers == ("device", "host"):
            self.work.d2h_bytes += nbytes


def flash_cpu_flops() -> dict[Any, Any]:
    """FLOP formulas for cpu's flash attention op (torch counts only the cuda ones): 4·B·H·T·S·D forward
    (QKᵀ and PV), 2.5x that backward (scores recomputed, then dV, dP, dQ, dK), grouped-query heads
    counted at the query's head count."""

    def forward(query: Any, key: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
        b, h, t, d = query.shape
        return 4 * b * h * t * key.shape[-2] * d

    def backward(grad_out: Any, query: Any, key: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return 10 * forward(query, key) // 4

    forward._get_raw = backward._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode: raw args
    ops = torch.ops.aten
    return {
        ops._scaled_dot_product_flash_attention_for_cpu: forward,
        ops._scaled_dot_product_flash_attention_for_cpu_backward: backward,
    }


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step and its parts, with the hardware row they came from."""

    step_s: float
    micro_batch_s: float
    optimizer_s: float
    hardware: Hardware

    def as_dict(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "micro_batch_s": self.micro_batch_s,
            "optimizer_s": self.optimizer_s,
            "hardware": asdict(self.hardware),
        }


def step_time(micro_batch: StepWork, optimizer: StepWork, micro_num: int, hw: Hardware) -> StepTime:
    """The model in the module docstring."""
    compute = micro_batch.flops / hw.flops_per_s
    activation_copies = (micro_batch.h2d_bytes + micro_batch.d2h_bytes) / hw.link_bytes_per_s
    host_adds = micro_batch.host_add_bytes / host_bytes_per_s(hw)
    per_micro_batch = max(compute, activation_copies, host_adds)
    device_update = optimizer.device_adamw_elements * ADAMW_BYTES_PER_ELEMENT / hw.hbm_bytes_per_s
    host_update = optimizer.host_adamw_elements / hw.cpu_adam_elements_per_s
    copies = (optimizer.h2d_bytes + optimizer.d2h_bytes) / hw.link_bytes_per_s
    disk = optimizer.disk_bytes / hw.disk_bytes_per_s  # the states' reads and writes, overlapping their copies
    optimizer_s = max(device_update, host_update) + max(copies, disk)
    return StepTime(micro_num * per_micro_batch + optimizer_s, per_micro_batch, optimizer_s, hw)


def shared_by(hw: Hardware, ranks_per_node: int) -> Hardware:
    """The row one rank sees when `ranks_per_node` ranks share the node's host memory bandwidth: host adds and
    the CPU AdamW step get its share, and its device's link carries at most that share."""
    if ranks_per_node <= 1:
        return hw
    share = host_bytes_per_s(hw) / ranks_per_node
    return replace(
        hw,
        link_bytes_per_s=min(hw.link_bytes_per_s, share),
        cpu_adam_elements_per_s=hw.cpu_adam_elements_per_s / ranks_per_node,
        disk_bytes_per_s=hw.disk_bytes_per_s / ranks_per_node,
        source=f"{hw.source}; the host shared by {ranks_per_node} ranks per node",
    )


def host_bytes_per_s(hw: Hardware) -> float:
    """Host memory bandwidth, as the row's CPU AdamW rate assumes it (that step is bound by it)."""
    return hw.cpu_adam_elements_per_s * ADAMW_BYTES_PER_ELEMENT


def calibrate(repeats: int = 5) -> Hardware:
    """This machine's row, measured: fp32 matmul FLOP/s, memcpy bytes/s (host and "device" are one RAM on
    cpu, so it stands for the link and the device memory), fused AdamW elements/s. Medians of `repeats`."""
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops = 2 * n**3 / _median_seconds(lambda: torch.mm(a, b), repeats)
    src, dst = torch.randn(32 << 20), torch.empty(32 << 20)
    copy_bytes = 2 * src.nbytes / _median_seconds(lambda: dst.copy_(src), repeats)  # read + write
    param = torch.randn(8 << 20, requires_grad=True)
    param.grad = torch.randn_like(param)
    adamw = torch.optim.AdamW([param], fused=True)
    elements = param.numel() / _median_seconds(adamw.step, repeats)
    return Hardware(
        "this machine (cpu)",
        flops,
        copy_bytes / 2,
        copy_bytes,
        elements,
        f"measured by --calibrate: {n}x{n} fp32 matmul, {src.nbytes >> 20} MiB copy_, fused AdamW over "
        f"{param.numel() >> 20} Mi elements; medians of {repeats}",
    )


def _median_seconds(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
