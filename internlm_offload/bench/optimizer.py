"""Optimizer offload on cpu: step time, optimizer state on the "device" and bitwise params per configuration.

    python -m internlm_offload.bench.optimizer [--quick] [--out bench_results/optimizer.json]

Four parts, one process: the offload configurations against fused AdamW (the swap optimizer's states in
host memory and, `swap_t4_nvme`, in a file under `--nvme-dir`, with this disk's measured bandwidth); CPU AdamW throughput
(for-loop, foreach, fused, the hybrid optimizer's CPU path, DeepSpeedCPUAdam where it imports); the
state round trip (offload + reload) of many small tensors through a coalesced arena vs one copy per
tensor; and what one hand-off to a cpu side stream costs (it bounds how small chunks can usefully be).

Every configuration owns an identically seeded copy of the params and gets the same grads before every
step; configurations step round-robin (rotating the start) in one process. On cpu the "device" and the
host are the same RAM: `host_empty` buffers live in /dev/shm (`RssShmem`), the rest is `RssAnon`, and every
H2D/D2H copy is a memcpy (see docs/benchmarks_optimizer.md). Not imported by the library.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import queue
import resource
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from internlm_offload.bench.timing import machine
from internlm_offload.device import Accelerator, HostArena, aligned_offsets, host_alloc
from internlm_offload.device.cpu_memory import rss_anon_bytes
from internlm_offload.device.disk_buffers import DiskBuffer
from internlm_offload.optim.adamw import AdamW
from internlm_offload.optim.hybrid import HybridDeviceOptimizer
from internlm_offload.optim.interface import OffloadOptimizer
from internlm_offload.optim.swap import SLOT_ALIGNMENT, SwapAdamW

HYPER = {"lr": 1e-3, "weight_decay": 1e-2}
QUICK = {"elements": 300_000, "tensors": 12, "repeats": 3, "warmup": 1, "round_trip_tensors": 40, "disk_test_mib": 4}
Factory = Callable[[list[torch.Tensor], Accelerator], torch.optim.Optimizer]


def _swap(times: int, arena: bool = False, nvme: str | None = None) -> Factory:
    return lambda params, acc: SwapAdamW(
        params,
        fused=True,
        swap_optimizer_times=times,
        use_pinned_optimizer_offload=arena,
        nvme_path=nvme,
        accelerator=acc,
        **HYPER,
    )


def _hybrid(fraction: float, overlap: bool = True) -> Factory:
    return lambda params, acc: HybridDeviceOptimizer(
        params, offload_fraction=fraction, accelerator=acc, overlap_cpu_optimizer_d2h_h2d=overlap, **HYPER
    )


CONFIGS: dict[str, Factory] = {
    "baseline_adamw_fused": lambda params, acc: AdamW(params, fused=True, **HYPER),
    "swap_t1": _swap(1),
    "swap_t4": _swap(4),
    "swap_t16": _swap(16),
    "swap_t4_arena": _swap(4, arena=True),
    "hybrid_f0.5": _hybrid(0.5),
    "hybrid_f1.0": _hybrid(1.0),
    "hybrid_f0.5_no_overlap": _hybrid(0.5, overlap=False),
}


def _deepspeed_cpu_adam(params: list[torch.Tensor], acc: Accelerator) -> torch.optim.Optimizer:
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # optional; builds its C++ op on first use

    return DeepSpeedCPUAdam(params, adamw_mode=True, **HYPER)


CPU_ADAMW: dict[str, Factory] = {
    "for_loop": lambda params, acc: torch.optim.AdamW(params, foreach=False, fused=False, **HYPER),
    "foreach": lambda params, acc: torch.optim.AdamW(params, foreach=True, **HYPER),
    "fused": lambda params, acc: torch.optim.AdamW(params, fused=True, **HYPER),
    # HybridDeviceOptimizer with every param on the CPU: its CPU step plus the grad and param copies.
    "hybrid_cpu_path": _hybrid(1.0),
    "deepspeed_cpu_adam": _deepspeed_cpu_adam,
}


def deepspeed_status() -> str | None:
    """None when DeepSpeedCPUAdam builds and steps here; otherwise why not, in one line."""
    try:
        p = torch.zeros(8, requires_grad=True)
        p.grad = torch.ones(8)
        _deepspeed_cpu_adam([p], Accelerator("cpu")).step()
    except Exception as exc:  # noqa: BLE001  ImportError, or a failed JIT build of its C++ op
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return None


@dataclass
class Case:
    """One configuration: its own params and optimizer, and what its steps measured."""

    name: str
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    rss_anon_delta: int = 0
    times: list[float] = field(default_factory=list)
    faults: list[int] = field(default_factory=list)  # minor page faults per timed step (all threads)


def tensor_sizes(elements: int, tensors: int, seed: int = 0) -> list[int]:
    """`tensors` odd sizes, log-uniform over ~3 decades, summing to about `elements`."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.exp(torch.rand(tensors, generator=gen, dtype=torch.float64) * 7.0)
    return [max(1, round(w)) | 1 for w in (weights / weights.sum() * elements).tolist()]


def seeded(sizes: list[int], seed: int) -> list[torch.Tensor]:
    """One normal fp32 tensor per size, from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in sizes]


def _malloc_trim() -> None:
    """Give freed heap pages back to the OS so `RssAnon` counts live memory only (no-op without glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def build_case(
    name: str, init: list[torch.Tensor], grads: list[torch.Tensor], acc: Accelerator, factories: dict | None = None
) -> Case:
    """Fresh params and optimizer, plus a first step (states allocated); records the `RssAnon` growth."""
    gc.collect()
    _malloc_trim()
    before = rss_anon_bytes()
    params = [t.clone().requires_grad_() for t in init]
    for p in params:
        p.grad = torch.empty_like(p)
    case = Case(name, params, (factories or CONFIGS)[name](params, acc))
    step(case, grads, acc)
    gc.collect()
    _malloc_trim()
    case.rss_anon_delta = rss_anon_bytes() - before
    return case


def step(case: Case, grads: list[torch.Tensor], acc: Accelerator) -> tuple[float, int]:
    """Reset the grads (untimed), then one `optimizer.step()` until every stream is idle; (seconds, faults)."""
    for p, g in zip(case.params, grads, strict=True):
        p.grad.copy_(g)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    case.optimizer.step()
    acc.synchronize()  # SwapAdamW's last copy-outs run on a side stream after step() returns
    seconds = time.perf_counter() - start
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def time_cases(cases: list[Case], grads: list[torch.Tensor], args: argparse.Namespace, acc: Accelerator) -> None:
    """Warm-up, then timed steps, round-robin with a rotating start."""
    for rep in range(args.warmup + args.repeats):
        k = rep % len(cases)
        for case in cases[k:] + cases[:k]:
            seconds, faults = step(case, grads, acc)
            if rep >= args.warmup:
                case.times.append(seconds)
                case.faults.append(faults)


def memory(optimizer: OffloadOptimizer) -> dict[str, int]:
    """The optimizer's `memory_stats()`; a plain AdamW reports none: it keeps every state on the device all the time."""
    stats = optimizer.memory_stats()
    if stats:
        return stats
    states = sum(t.nbytes for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    return {"device_state_bytes": states, "peak_device_state_bytes": states, "host_state_bytes": 0}


def summarize(case: Case, base: Case) -> dict[str, Any]:
    """The JSON record of one configuration."""
    median = statistics.median(case.times)
    deciles = statistics.quantiles(case.times, n=10, method="inclusive") if len(case.times) > 1 else [median] * 9
    return {
        "name": case.name,
        "step_s_median": median,
        "step_s_p10": deciles[0],
        "step_s_p90": deciles[-1],
        "step_s": case.times,
        "ratio": median / statistics.median(base.times),
        **memory(case.optimizer),
        "rss_anon_delta_bytes": case.rss_anon_delta,
        "minor_faults_per_step": statistics.median(case.faults),
        "bitwise_equal": all(torch.equal(p, b) for p, b in zip(case.params, base.params, strict=True)),
    }


def throughput(case: Case, base: Case) -> dict[str, Any]:
    """The JSON record of one CPU AdamW: elements per second, and the traffic it implies at 28 B/element."""
    median = statistics.median(case.times)
    elements = sum(p.numel() for p in case.params)
    return {
        "name": case.name,
        "step_s_median": median,
        "step_s": case.times,
        "elements_per_s": elements / median,
        "gb_per_s_at_28_bytes": 28 * elements / median / 1e9,
        "vs_fused": median / statistics.median(base.times),
        "bitwise_equal_to_fused": all(torch.equal(p, b) for p, b in zip(case.params, base.params, strict=True)),
    }


def disk_bandwidth(directory: Path, nbytes: int, repeats: int) -> dict[str, Any]:
    """This disk's bandwidth through the NVMe tier's own path: write `nbytes` into a mapped file and write them
    back (msync, pages dropped), then read them in again (read ahead, then touched); medians of `repeats`."""
    disk = DiskBuffer(directory, nbytes)
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    writes, reads = [], []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            disk.tensor[:nbytes].copy_(data)
            disk.write_back(0, nbytes)
            disk.finish_writes()
            writes.append(time.perf_counter() - start)
            start = time.perf_counter()
            disk.prefetch(0, nbytes)  # as the tier reads a chunk: ahead of the copy that touches it
            total = int(disk.tensor[:nbytes].sum())  # touches every page
            reads.append(time.perf_counter() - start)
            assert total == int(data.sum())
    finally:
        disk.release()
    return {
        "directory": str(directory),
        "bytes": nbytes,
        "write_gb_per_s": nbytes / statistics.median(writes) / 1e9,
        "read_gb_per_s": nbytes / statistics.median(reads) / 1e9,
        "write_s": writes,
        "read_s": reads,
    }


def round_trip(tensors: int, repeats: int, acc: Accelerator) -> dict[str, Any]:
    """Offload + reload of two fp32 states for each of `tensors` params: one copy per tensor vs one arena span.

    The device side is the same in both: the states as aligned views of one flat buffer (as SwapAdamW
    stages them). Per-tensor: a host buffer per state and one copy per tensor each way (all in one
    stream task, so the stream's per-task cost on cpu is not counted); arena: one host slab laid out
    like the device buffer, one copy each way. Timed alternately.
    """
    sizes = [n for n in tensor_sizes(1000 * tensors, tensors, seed=3) for _ in range(2)]  # exp_avg, exp_avg_sq
    specs = [((n,), torch.float32) for n in sizes]
    offsets, end = aligned_offsets(specs, SLOT_ALIGNMENT)
    device_flat = torch.randn(end // 4 + 1).view(torch.uint8)[:end]
    device = [device_flat[o : o + 4 * n].view(torch.float32) for o, n in zip(offsets, sizes)]
    per_tensor = [acc.host_empty((n,), torch.float32, pinned=False) for n in sizes]
    arena = HostArena(acc, specs, pinned=acc.supports_pinned_memory, alignment=SLOT_ALIGNMENT)
    span = arena.span(0, end)
    stream = acc.stream()
    modes = {
        "per_tensor": lambda: acc.copy_async(per_tensor, device, stream),
        "arena": lambda: acc.copy_async(span, device_flat, stream),
    }
    reloads = {
        "per_tensor": lambda: acc.copy_async(device, per_tensor, stream),
        "arena": lambda: acc.copy_async(device_flat, span, stream),
    }
    times: dict[str, list[float]] = {name: [] for name in modes}
    for rep in range(repeats + 1):
        for name in modes if rep % 2 else reversed(list(modes)):
            start = time.perf_counter()
            modes[name]()
            reloads[name]()
            stream.synchronize()
            if rep:  # the first round is warm-up
                times[name].append(time.perf_counter() - start)
    stream.close()
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        "tensors": tensors,
        "state_tensors": len(sizes),
        "state_bytes": 4 * sum(sizes),
        "round_trip_s": times,
        "median_s": medians,
        "arena_speedup": medians["per_tensor"] / medians["arena"],
    }


def stream_handoff(repeats: int, acc: Accelerator) -> dict[str, Any]:
    """What one hand-off to a side stream and back costs here, against bare Python threads.

    Stream: the compute stream's work is handed to a cpu side stream (`wait_stream`), a 16-element copy runs
    there, and the caller blocks on its event, as a chunk's copy-in before its update does. Bare: a
    `SimpleQueue` put to a worker thread that sets a `threading.Event` the caller waits on (the cheapest
    hand-off between two Python threads). Alternated, one round trip per sample; medians in microseconds.
    """
    stream, src, dst = acc.stream(), torch.zeros(16), torch.zeros(16)
    jobs: queue.SimpleQueue = queue.SimpleQueue()

    def run_jobs() -> None:
        for job in iter(jobs.get, None):
            job()

    worker = threading.Thread(target=run_jobs, daemon=True)
    worker.start()

    def through_stream() -> None:
        stream.wait_stream(acc.current_stream())
        acc.copy_async(dst, src, stream)
        stream.record_event().synchronize()

    def bare() -> None:
        done = threading.Event()
        jobs.put(done.set)
        done.wait()

    samples: dict[str, list[float]] = {"cpu_stream": [], "bare_threads": []}
    for rep in range(repeats + 10):  # the first 10 rounds warm up
        for name, fn in (("cpu_stream", through_stream), ("bare_threads", bare))[:: 1 if rep % 2 else -1]:
            start = time.perf_counter()
            fn()
            if rep >= 10:
                samples[name].append(time.perf_counter() - start)
    jobs.put(None)
    worker.join()
    stream.close()
    return {f"{name}_round_trip_us": 1e6 * statistics.median(t) for name, t in samples.items()}


def copy_floor(cases: list[Case], grads: list[torch.Tensor], repeats: int, acc: Accelerator) -> dict[str, Any]:
    """What swapping costs at least here: the states' bytes copied in and out, serial and overlapped.

    Alternates three rounds: one baseline step; one plain copy of every swapped state (exp_avg and
    exp_avg_sq, 8 bytes per param) host -> device -> host on the calling thread; and the same copies on a
    side stream while the calling thread runs the step (what a perfect overlap could buy). The serial
    floor is (step + copies) / step; `overlap_ratio` is the concurrent round over the step: on a
    machine where copies and the update share cores and memory bandwidth, overlap buys little.
    """
    base = cases[0]
    states = 2 * sum(p.numel() for p in base.params)
    device_states = torch.zeros(states)
    host_states = acc.host_empty((states,), torch.float32, pinned=False).copy_(device_states)
    stream = acc.stream()
    copies: list[float] = []
    steps: list[float] = []
    overlapped: list[float] = []
    for _ in range(repeats + 1):
        steps.append(step(base, grads, acc)[0])
        start = time.perf_counter()
        device_states.copy_(host_states)
        host_states.copy_(device_states)
        copies.append(time.perf_counter() - start)
        for p, g in zip(base.params, grads, strict=True):
            p.grad.copy_(g)
        start = time.perf_counter()
        acc.copy_async([device_states, host_states], [host_states, device_states], stream)
        base.optimizer.step()
        stream.synchronize()
        overlapped.append(time.perf_counter() - start)
    stream.close()
    copy_s, step_s = statistics.median(copies[1:]), statistics.median(steps[1:])
    both_s = statistics.median(overlapped[1:])
    return {
        "state_bytes": 4 * states,
        "copy_in_out_s": copy_s,
        "baseline_step_s": step_s,
        "floor_ratio": (step_s + copy_s) / step_s,
        "copy_gb_per_s": 2 * 4 * states / copy_s / 1e9,
        "overlapped_s": both_s,
        "overlap_ratio": both_s / step_s,
    }


def environment(args: argparse.Namespace, sizes: list[int]) -> dict[str, Any]:
    """What the numbers depend on: versions, threads, cores, sizes, host tier."""
    return {
        **machine(),
        "elements": sum(sizes),
        "tensors": len(sizes),
        "min_tensor": min(sizes),
        "max_tensor": max(sizes),
        "dtype": "float32",
        "repeats": args.repeats,
        "warmup": args.warmup,
        "steps_per_config": 1 + args.warmup + args.repeats,
        "hyper": HYPER,
        "shm_dir": host_alloc.SHM_DIR,
        "shm_writable": os.access(host_alloc.SHM_DIR, os.W_OK),
        "loadavg_1m_at_end": os.getloadavg()[0],  # other processes on the box skew the times
    }


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Step time ratio against peak device optimizer state, one labelled point per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    same_x: dict[int, int] = {}  # labels of points at the same memory are stacked, not overlaid
    for rec in sorted(records, key=lambda r: -r["ratio"]):  # the upper point of a stack gets the upper label
        x, y = rec["peak_device_state_bytes"] / 2**20, rec["ratio"]
        k = same_x[rec["peak_device_state_bytes"]] = same_x.get(rec["peak_device_state_bytes"], -1) + 1
        ax.scatter(x, y, color="tab:blue" if rec["bitwise_equal"] else "tab:red")
        ax.annotate(rec["name"], (x, y), textcoords="offset points", xytext=(4, 4 - 11 * k), fontsize=8)
    ax.set(xlabel="peak optimizer state on the device during step (MiB)", ylabel="median step time / baseline")
    ax.set_title("Optimizer offload on cpu (red: params differ from baseline)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(records: list[dict[str, Any]]) -> None:
    """The summary on stdout, one line per configuration (memory in MiB)."""
    print(
        f"{'config':<24}{'median ms':>10}{'p10':>8}{'p90':>8}{'ratio':>7}{'peak dev':>10}{'host':>8}"
        f"{'anon':>8}{'faults':>8}  bitwise"
    )
    for r in records:
        ms = "".join(f"{r[k] * 1e3:>{w}.1f}" for k, w in (("step_s_median", 10), ("step_s_p10", 8), ("step_s_p90", 8)))
        mib = [r[k] / 2**20 for k in ("peak_device_state_bytes", "host_state_bytes", "rss_anon_delta_bytes")]
        print(
            f"{r['name']:<24}{ms}{r['ratio']:>7.2f}{mib[0]:>10.1f}{mib[1]:>8.1f}{mib[2]:>8.1f}"
            f"{r['minor_faults_per_step']:>8.0f}  {r['bitwise_equal']}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options; `--quick` gives tiny defaults (for tests), explicit flags still win."""
    p = argparse.ArgumentParser(prog="python -m internlm_offload.bench.optimizer", description=__doc__.split("\n")[0])
    p.add_argument("--elements", type=int, default=24_000_000, help="fp32 elements in all params together")
    p.add_argument("--tensors", type=int, default=100, help="number of param tensors")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration after the first")
    p.add_argument("--round-trip-tensors", type=int, default=2000, help="params in the offload+reload comparison")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("bench_results/optimizer.json"))
    p.add_argument(
        "--nvme-dir",
        type=Path,
        default=None,
        help="directory for the NVMe row's states file and the disk bandwidth test (default: beside --out)",
    )
    p.add_argument("--disk-test-mib", type=int, default=512, help="bytes the disk bandwidth test writes and reads")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for tests")
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.tensors < 1 or args.elements < args.tensors:
        p.error("need --repeats >= 1, --warmup >= 0, --tensors >= 1 and --elements >= --tensors")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every configuration, write the JSON and a PNG beside it, print a table; 1 if any is not bitwise."""
    # `build_case` collects twice per configuration so that `RssAnon` counts live memory only; with what was alive
    # before the run frozen, each collection scans only the benchmark's own objects: 0.3 s each with torch's objects
    # in sight (0.5 s inside a test process), 26 of them in a run
    gc.freeze()
    try:
        return _run(parse_args(argv))
    finally:
        gc.unfreeze()


def _run(args: argparse.Namespace) -> int:
    """`main` on its parsed options."""
    if args.threads:
        torch.set_num_threads(args.threads)
    acc = Accelerator("cpu")
    sizes = tensor_sizes(args.elements, args.tensors)
    init, grads = seeded(sizes, seed=1), seeded(sizes, seed=2)
    deepspeed_missing = deepspeed_status()
    adamw_names = [n for n in CPU_ADAMW if n != "deepspeed_cpu_adam" or deepspeed_missing is None]
    nvme_dir = args.nvme_dir or args.out.parent / "nvme"
    nvme_dir.mkdir(parents=True, exist_ok=True)
    configs = dict(CONFIGS)
    if "swap_t4" in configs:
        configs["swap_t4_nvme"] = _swap(4, nvme=str(nvme_dir))  # swap_t4 with its states in a file
    try:
        disk = disk_bandwidth(nvme_dir, args.disk_test_mib * 2**20, args.repeats)
        cases = [build_case(name, init, grads, acc, configs) for name in configs]
        time_cases(cases, grads, args, acc)
        records = [summarize(case, cases[0]) for case in cases]
        floor = copy_floor(cases, grads, args.repeats, acc)
        del cases
        adamw_cases = [build_case(name, init, grads, acc, CPU_ADAMW) for name in adamw_names]
        time_cases(adamw_cases, grads, args, acc)
        fused = next(c for c in adamw_cases if c.name == "fused")
        adamw = [throughput(case, fused) for case in adamw_cases]
        del adamw_cases
        trip = round_trip(args.round_trip_tensors, args.repeats, acc)
        handoff = stream_handoff(25 * args.repeats, acc)
    finally:
        acc.close_streams()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "env": environment(args, sizes),
        "results": records,
        "disk_bandwidth": disk,
        "swap_copy_floor": floor,
        "cpu_adamw": adamw,
        "deepspeed_cpu_adam": deepspeed_missing or "measured",
        "arena_round_trip": trip,
        "stream_handoff": handoff,
    }
    args.out.write_text(json.dumps(report, indent=2))
    plot(records, args.out.with_suffix(".png"))
    print_table(records)
    named = {r["name"]: r for r in records}
    nvme, host = named.get("swap_t4_nvme"), named.get("swap_t4")
    if nvme and host:
        print(
            f"NVMe tier ({nvme_dir}): disk writes {disk['write_gb_per_s']:.2f} GB/s, reads "
            f"{disk['read_gb_per_s']:.2f} GB/s; swap_t4 on disk {nvme['step_s_median'] * 1e3:.1f} ms vs in host "
            f"memory {host['step_s_median'] * 1e3:.1f} ms ({nvme['step_s_median'] / host['step_s_median']:.2f}x), "
            f"bitwise {nvme['bitwise_equal']}"
        )
    print(
        f"swap's copy floor: {floor['state_bytes'] / 2**20:.0f} MiB in and out {floor['copy_in_out_s'] * 1e3:.1f} ms "
        f"({floor['copy_gb_per_s']:.1f} GB/s moved) against a {floor['baseline_step_s'] * 1e3:.1f} ms step: "
        f"ratio >= {floor['floor_ratio']:.2f} serial, {floor['overlap_ratio']:.2f} with the copies on a side stream "
        f"during the step"
    )
    print_throughput(adamw, deepspeed_missing)
    print(
        f"offload+reload of {trip['state_tensors']} state tensors ({trip['state_bytes'] / 2**20:.1f} MiB): "
        f"per-tensor {trip['median_s']['per_tensor'] * 1e3:.2f} ms, arena {trip['median_s']['arena'] * 1e3:.2f} ms, "
        f"arena {trip['arena_speedup']:.1f}x faster"
    )
    print(
        f"one hand-off to a cpu side stream and back: {handoff['cpu_stream_round_trip_us']:.0f} us "
        f"(bare Python threads: {handoff['bare_threads_round_trip_us']:.0f} us)"
    )
    return 0 if all(r["bitwise_equal"] for r in records) else 1


def print_throughput(records: list[dict[str, Any]], deepspeed_missing: str | None) -> None:
    print(f"\n{'cpu adamw':<24}{'median ms':>10}{'Melem/s':>10}{'GB/s@28B':>10}{'vs fused':>10}")
    for r in records:
        print(
            f"{r['name']:<24}{r['step_s_median'] * 1e3:>10.1f}{r['elements_per_s'] / 1e6:>10.0f}"
            f"{r['gb_per_s_at_28_bytes']:>10.1f}{r['vs_fused']:>10.2f}"
        )
    if deepspeed_missing:
        print(f"{'deepspeed_cpu_adam':<24}not measured: {deepspeed_missing}")


if __name__ == "__main__":
    raise SystemExit(main())
