"""Step time from the traced step's work and a machine's throughputs: a stated model, not a measurement.

The trace counts, per micro-batch and per optimizer step: matmul, grouped-expert and attention FLOPs (torch's
`FlopCounterMode` formulas, recomputation included; an op on DTensors counts this rank's share), bytes copied
between host and device (every `copy_` whose source and destination lie in different tiers), bytes that
additions into host tensors read and write (gradient offload's accumulation), AdamW and Muon elements stepped
on the device and on the host, the FLOPs of matmuls on host tensors (the hybrid's CPU share of Muon's
Newton-Schulz), and the bytes each rank sends in the tensor and sequence parallel
collectives (torch's functional collectives: DTensor's redistributions, Ulysses' all-to-all; ring
algorithms, so a collective over n ranks sends (n-1)/n of its buffer, twice for an all-reduce). Collectives
DTensor issues inside one of its own ops (loss_parallel's reductions over the vocabulary) are not seen; they
move a few values per token. Elements and bytes of DTensors are their local shards'.
`step_time` turns them into seconds with a `Hardware` row:

    micro-batch = max(FLOPs / flops_per_s, copies / link_bytes_per_s,   activation and gradient copies
                      host adds / host_bytes_per_s)                      and the host's adds overlap compute;
                  + collectives / collective_bytes_per_s                 the tensor-parallel ones do not
    optimizer   = max(device AdamW elements x 28 B / hbm_bytes_per_s     the hybrid's CPU share overlaps
                        + device Muon elements x 20 B / hbm_bytes_per_s  the device step; Muon's
                        + device FLOPs / bf16_flops_per_s,               Newton-Schulz is its FLOPs (5
                      host AdamW elements / cpu_adam_elements_per_s      steps of 3 matmuls per matrix),
                        + host Muon elements x 20 B / host_bytes_per_s   on the device, or on the host
                        + host FLOPs / cpu_flops_per_s)                  for the hybrid's CPU share
                  + max(step copies / link_bytes_per_s,                  swap and hybrid traffic, not hidden;
                        disk bytes / disk_bytes_per_s)                   the two directions overlap on a
                                                                         device (the larger counts; both on
                                                                         cpu), NVMe reads and writes too
                  + collectives / collective_bytes_per_s                 the norm over tensor shards;
                                                                         Muon's gathers of whole matrices
                                                                         (bf16, optim/muon_sharded.py)
    step        = micro_num x micro-batch + optimizer
    pipeline    = the makespan of torch's schedule order + optimizer     each rank's micro-batch time split
                                                                         over its stages, backward = 2 x
                                                                         forward (planner/pipeline.py)

The host's memory bandwidth is the one the CPU AdamW rate assumes (`host_bytes_per_s`: elements/s x 28 B).
Ranks on one node share it (`shared_by`): each gets its share for host adds and the CPU AdamW step, and
its device's link is capped at that share; a row describes one device and the node's host.
Rows for common accelerators are assumptions (their sources say so, and the planner prints them);
`calibrate()` measures this machine's rows instead (cpu: matmul, memcpy, fused AdamW; its collective
bandwidth is stated: gloo's needs a process group of several processes).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from internlm_offload.optim.adamw_rule import ADAMW
from internlm_offload.optim.dtensor import is_dtensor, local_nbytes, local_shard
from internlm_offload.optim.muon_rule import MUON
from internlm_offload.planner.tracker import StorageTracker, copies_meta_to_cpu

# The update rules a traced step may run: each one's kernels are counted (`kernel_ops`), its bytes per element price
# its elementwise step; the host's CPU rate (`cpu_adam_elements_per_s`) is measured on AdamW's.
PLANNED_RULE = ADAMW
ADAMW_BYTES_PER_ELEMENT = PLANNED_RULE.update_bytes
ADAMW_OPS = PLANNED_RULE.kernel_ops
MUON_BYTES_PER_ELEMENT = MUON.update_bytes
MUON_OPS = MUON.kernel_ops
MATMUL_OPS = ("aten.mm.default", "aten.addmm.default")  # Newton-Schulz's; on host tensors, the CPU's FLOPs
ADD_OPS = ("aten.add_.Tensor", "aten.add.out")
# Functional collectives (what DTensor and Ulysses issue) -> how many times its buffer a rank sends, times
# (n-1)/n: all-gather and reduce-scatter send one buffer's worth (the larger side), all-reduce two. FSDP2's
# and DDP's collectives (c10d ops on their own streams) overlap compute and are not priced.
COLLECTIVES = {
    "_c10d_functional.all_gather_into_tensor.default": 1,
    "_c10d_functional.reduce_scatter_tensor.default": 1,
    "_c10d_functional.all_reduce.default": 2,
    "_c10d_functional.all_to_all_single.default": 1,
}


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
    # Matmul FLOP/s of the host's cores (the hybrid's CPU share of Muon's Newton-Schulz, bf16); stated, as disk's.
    cpu_flops_per_s: float = 1e12
    cpu_flops_source: str = "assumed: ~1 TFLOP/s bf16 matmul on a server's cores (AMX); calibrate() measures it"
    # bf16 matmul FLOP/s on the device (Newton-Schulz's dtype); None: `flops_per_s` (the rows' are bf16 already;
    # cpu's calibrated `flops_per_s` is fp32's, which a bf16 matmul beats by ~1.8x on AVX512-BF16 here)
    bf16_flops_per_s: float | None = None
    # Bytes per second each rank sends in a collective within its node (NCCL's "bus bandwidth").
    collective_bytes_per_s: float = 1e9
    collective_source: str = "assumed: gloo over loopback TCP (measured here: 0.25-1.4 GB/s)"
    # A device's copy engines move both directions at once (the swap optimizer's swap-in of one chunk beside
    # the swap-out of the one before); on cpu both directions are memcpy over one memory bus.
    duplex_link: bool = True


HARDWARE = {
    "h100": Hardware(
        "H100 SXM 80GB",
        400e12,
        50e9,
        2.7e12,
        3e9,
        "assumed: 40% MFU of 989 TFLOP/s dense bf16; PCIe 5.0 x16 ~50 GB/s; 80% of 3.35 TB/s HBM3; "
        "host fused AdamW 3e9 elem/s (~100 GB/s DRAM at 28 B/elem)",
        collective_bytes_per_s=360e9,
        collective_source="assumed: NVLink 4 (450 GB/s per direction), ~80% as NCCL's bus bandwidth",
    ),
    "h200": Hardware(
        "H200 SXM 141GB",
        400e12,
        50e9,
        3.8e12,
        3e9,
        "assumed: 40% MFU of 989 TFLOP/s dense bf16; link measured by scripts/gpu_check.sh on one H200 "
        "(2026-11-26): 49-55 GB/s per direction, pinned, PCIe 5.0 x16; 80% of 4.8 TB/s HBM3e; "
        "host fused AdamW 3e9 elem/s",
        collective_bytes_per_s=360e9,
        collective_source="assumed: NVLink 4 (450 GB/s per direction), ~80% as NCCL's bus bandwidth",
    ),
    "a100": Hardware(
        "A100 SXM 80GB",
        125e12,
        25e9,
        1.6e12,
        3e9,
        "assumed: 40% MFU of 312 TFLOP/s dense bf16; PCIe 4.0 x16 ~25 GB/s; 80% of 2.0 TB/s HBM2e; "
        "host fused AdamW 3e9 elem/s",
        collective_bytes_per_s=230e9,
        collective_source="assumed: NVLink 3 (300 GB/s per direction), ~75% as NCCL's bus bandwidth",
    ),
    "910b": Hardware(
        "Ascend 910B",
        125e12,
        25e9,
        1.3e12,
        3e9,
        "assumed: 40% of ~313 TFLOP/s fp16/bf16; PCIe 4.0 x16 ~25 GB/s; 80% of 1.6 TB/s HBM; "
        "host fused AdamW 3e9 elem/s",
        collective_bytes_per_s=100e9,
        collective_source="assumed: HCCS within a node, ~100 GB/s as HCCL's bus bandwidth",
    ),
}


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
    collective_bytes: int = 0  # sent by this rank in tensor and sequence parallel collectives
    device_muon_elements: int = 0  # Muon's elementwise step (its momentum update), per tier
    host_muon_elements: int = 0
    host_flops: int = 0  # part of `flops`: matmuls on host tensors (the hybrid's CPU share of Newton-Schulz)

    def scaled(self, factor: float) -> StepWork:
        return StepWork(**{k: int(v * factor) for k, v in asdict(self).items()})

    def __add__(self, other: StepWork) -> StepWork:
        return StepWork(**{k: v + getattr(other, k) for k, v in asdict(self).items()})

    def __sub__(self, other: StepWork) -> StepWork:
        return self + other.scaled(-1)


@dataclass(eq=False)
class WorkCounter(TorchDispatchMode):
    """Counts copies between tiers, AdamW elements and collective bytes while active (tiers from the tracker).

    `sharded_flops_surplus`: what a FLOP counter beside it over-counts: it sees ops on DTensors with their
    global shapes, while each rank computes the share its output's placements give it."""

    tracker: StorageTracker
    work: StepWork = field(default_factory=StepWork)
    sharded_flops_surplus: int = 0

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
            elements = sum(local_shard(p).numel() for p in params)  # FSDP2 and tensor parallel step their shards
            if params and self.tracker.tier_of(params[0]) == "host":
                self.work.host_adamw_elements += elements
            else:
                self.work.device_adamw_elements += elements
        elif name in MUON_OPS:  # one parameter's momentum buffer (its shard's, as the parameter's)
            buffer = args[0]
            if self.tracker.tier_of(buffer) == "host":
                self.work.host_muon_elements += local_shard(buffer).numel()
            else:
                self.work.device_muon_elements += local_shard(buffer).numel()
        elif name in MATMUL_OPS and self.tracker.tier_of(args[-1]) == "host":
            self.work.host_flops += flop_registry[func.overloadpacket](*args, **(kwargs or {}), out_val=None)
        elif name in COLLECTIVES:
            self.work.collective_bytes += _sent_bytes(name, args)
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in flop_registry and any(is_dtensor(a) for a in args):
            self.sharded_flops_surplus += _sharded_flops_surplus(func, args, kwargs or {}, out)
        return out

    def _count_add(self, args: tuple, kwargs: dict) -> None:
        """An addition into a host tensor: it reads and writes the result, and reads the added tensor."""
        out = kwargs.get("out", args[0])
        if self.tracker.tier_of(out) != "host":
            return
        added = [a for a in args if torch.is_tensor(a) and a is not out]
        self.work.host_add_bytes += 2 * local_nbytes(out) + sum(local_nbytes(a) for a in added)

    def _count_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        tiers = (self.tracker.tier_of(src) or "device", self.tracker.tier_of(dst) or "device")
        nbytes = local_nbytes(dst)
        if "disk" in tiers:  # through the page cache: a disk transfer and a host one
            self.work.disk_bytes += nbytes
            tiers = tuple("host" if tier == "disk" else tier for tier in tiers)
        if tiers == ("host", "device"):
            self.work.h2d_bytes += nbytes
        elif tiers == ("device", "host"):
            self.work.d2h_bytes += nbytes


def _sent_bytes(name: str, args: tuple) -> int:
    """Bytes one rank sends in the functional collective `name` over its group (ring algorithms)."""
    tensor = args[0]
    group = dist.distributed_c10d._resolve_process_group(args[-1])  # every one takes its group's name last
    ranks = group.size()
    nbytes = tensor.numel() * tensor.element_size()
    if name.startswith("_c10d_functional.all_gather"):
        nbytes *= ranks  # its output is the larger side
    return COLLECTIVES[name] * nbytes * (ranks - 1) // ranks


def _sharded_flops_surplus(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Global FLOPs of an op on DTensors minus this rank's share: the output's Shard and Partial mesh dims
    divide the work, Replicate ones repeat it on every rank."""
    result = out[0] if isinstance(out, (tuple, list)) else out
    if not is_dtensor(result):
        return 0
    total = flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
    shares = math.prod(
        result.device_mesh.size(dim) for dim, placement in enumerate(result.placements) if not placement.is_replicate()
    )
    return total - total // shares


class FlopCounter(TorchDispatchMode):
    """The total of torch's `FlopCounterMode` (its formulas, `custom_mapping` and decompositions alike) without
    its per-module table: that one's module tracker hooks every module and every block's gradients, which took
    a third of a traced step's time. `tests/unit/test_planner_cost.py` holds the two equal."""

    def __init__(self, custom_mapping: dict[Any, Any] | None = None) -> None:
        super().__init__()
        self.formulas = FlopCounterMode(display=False, custom_mapping=custom_mapping).flop_registry
        self.metadata = _metadata_ops()
        self.total = 0

    def get_total_flops(self) -> int:
        return self.total

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self.metadata:
            return NotImplemented
        if func is not torch.ops.prim.device.default:  # as FlopCounterMode: counted through its decomposition
            with self:
                out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
        out = func(*args, **kwargs)
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def _metadata_ops() -> set[Any]:
    """Ops that read a tensor's metadata: FlopCounterMode leaves them to the tensor (NotImplemented)."""
    aten = torch.ops.aten
    return {
        aten.sym_is_contiguous.default,
        aten.is_contiguous.default,
        aten.is_contiguous.memory_format,
        aten.is_strides_like_format.default,
        aten.is_non_overlapping_and_dense.default,
        aten.size.default,
        aten.sym_size.default,
        aten.stride.default,
        aten.sym_stride.default,
        aten.storage_offset.default,
        aten.sym_storage_offset.default,
        aten.numel.default,
        aten.sym_numel.default,
        aten.dim.default,
        torch.ops.prim.layout.default,
    }


def extra_flops() -> dict[Any, Any]:
    """FLOP formulas torch's counter lacks, for `FlopCounter`'s `custom_mapping`.

    cpu's flash attention op (torch counts only the cuda ones): 4·B·H·T·S·D forward (QKᵀ and PV), 2.5x that
    backward (scores recomputed, then dV, dP, dQ, dK), grouped-query heads counted at the query's head count.
    The grouped GEMM of stacked experts (`aten._grouped_mm`, model/experts.py), forward and the two backward
    products alike: 2 FLOPs per multiply-add over every group's rows (on meta, where no offsets are known, every
    row: a dropped GShard choice's too)."""

    def forward(query: Any, key: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
        b, h, t, d = query.shape
        return 4 * b * h * t * key.shape[-2] * d

    def backward(grad_out: Any, query: Any, key: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return 10 * forward(query, key) // 4

    def grouped_mm(a: Any, b: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
        if a.dim() == 3 and b.dim() == 3:  # (E, M, K) x (E, K, N): a batch
            return 2 * a.numel() * b.shape[-1]
        if a.dim() == 3:  # (E, M, K) x (K, N) cut into E column groups
            return 2 * a.shape[1] * a.shape[2] * b.shape[-1]
        # (M, K) x (E, K, N) cut into row groups, or (K, M) x (M, N) cut along M into (E, K, N): 2·M·K·N
        return 2 * a.shape[0] * a.shape[1] * b.shape[-1]

    for formula in (forward, backward, grouped_mm):
        formula._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode: raw args
    ops = torch.ops.aten
    return {
        ops._scaled_dot_product_flash_attention_for_cpu: forward,
        ops._scaled_dot_product_flash_attention_for_cpu_backward: backward,
        ops._grouped_mm: grouped_mm,
    }


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step and its parts, with the hardware row they came from."""

    step_s: float
    micro_batch_s: float
    optimizer_s: float
    hardware: Hardware
    bubble_fraction: float = 0.0  # a pipeline's: the share of its forward-backward time the slowest rank idles

    def as_dict(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "micro_batch_s": self.micro_batch_s,
            "optimizer_s": self.optimizer_s,
            "bubble_fraction": self.bubble_fraction,
            "hardware": asdict(self.hardware),
        }


def step_time(micro_batch: StepWork, optimizer: StepWork, micro_num: int, hw: Hardware) -> StepTime:
    """The model in the module docstring."""
    compute = micro_batch.flops / hw.flops_per_s
    activation_copies = (micro_batch.h2d_bytes + micro_batch.d2h_bytes) / hw.link_bytes_per_s
    host_adds = micro_batch.host_add_bytes / host_bytes_per_s(hw)
    collectives = micro_batch.collective_bytes / hw.collective_bytes_per_s  # on the critical path
    per_micro_batch = max(compute, activation_copies, host_adds) + collectives
    device_bytes = (
        optimizer.device_adamw_elements * ADAMW_BYTES_PER_ELEMENT
        + optimizer.device_muon_elements * MUON_BYTES_PER_ELEMENT
    )
    device_update = device_bytes / hw.hbm_bytes_per_s + (optimizer.flops - optimizer.host_flops) / (
        hw.bf16_flops_per_s or hw.flops_per_s
    )
    host_update = (
        optimizer.host_adamw_elements / hw.cpu_adam_elements_per_s
        + optimizer.host_muon_elements * MUON_BYTES_PER_ELEMENT / host_bytes_per_s(hw)
        + optimizer.host_flops / hw.cpu_flops_per_s
    )
    both_ways = (optimizer.h2d_bytes, optimizer.d2h_bytes)
    copies = (max(both_ways) if hw.duplex_link else sum(both_ways)) / hw.link_bytes_per_s
    disk = optimizer.disk_bytes / hw.disk_bytes_per_s  # the states' reads and writes, overlapping their copies
    norm = optimizer.collective_bytes / hw.collective_bytes_per_s  # the gradient norm over tensor shards
    optimizer_s = max(device_update, host_update) + max(copies, disk) + norm
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
        cpu_flops_per_s=hw.cpu_flops_per_s / ranks_per_node,
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
    a16, b16 = a.bfloat16(), b.bfloat16()
    bf16_flops = 2 * n**3 / _median_seconds(lambda: torch.mm(a16, b16), repeats)
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
        cpu_flops_per_s=bf16_flops,
        cpu_flops_source="measured by --calibrate: the same matmul in bf16 (host and device are one cpu)",
        bf16_flops_per_s=bf16_flops,
        source=f"measured by --calibrate: {n}x{n} fp32 matmul, {src.nbytes >> 20} MiB copy_, fused AdamW over "
        f"{param.numel() >> 20} Mi elements; medians of {repeats}",
        duplex_link=False,
    )


def _median_seconds(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
