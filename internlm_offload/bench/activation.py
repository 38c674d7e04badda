"""Activation memory on cpu: step time, peak "device" memory and bitwise grads per activation configuration.

    python -m internlm_offload.bench.activation [--quick] [--out bench_results/activation.json]

"Device memory" is `RssAnon`; the offloader's host buffers live in /dev/shm (`RssShmem`) and its copies are
memcpy (see docs/benchmarks.md). Configurations run round-robin, each on its own identically seeded model.
Timed steps use glibc's default malloc; the memory pass runs in a child process whose glibc maps every block
>= 1 MiB on its own (`MALLOC_MMAP_THRESHOLD_`), so `RssAnon` follows live tensors. Not imported by the library.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from internlm_offload.bench.timing import add_timing_arguments, machine, parse_timing_arguments
from internlm_offload.device import Accelerator, host_alloc
from internlm_offload.device.cpu_memory import PeakSampler, rss_anon_bytes
from internlm_offload.model.families.internlm2.model import InternLM2
from internlm_offload.offload import apply_activation_checkpointing
from internlm_offload.offload.activation import ActivationOffloader, offload_layers
from internlm_offload.offload.selective_offload import SelectiveOffloader, apply_selective_offload

VOCAB = 259
OFFLOAD_LAYERS = (2, 4, 7)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUICK = {"layers": 8, "hidden": 64, "heads": 4, "seq": 32, "batch": 2, "repeats": 2, "warmup": 1}
MMAP_THRESHOLD = 1 << 20  # bytes; glibc's mmap threshold in the memory pass (a fixed one also returns freed blocks)
MODULE = "internlm_offload.bench.activation"


@dataclass
class Case:
    """One configuration applied to its own model, and what its steps measured."""

    name: str
    num_layers: int  # blocks checkpointed or offloaded
    model: InternLM2
    handle: ActivationOffloader | SelectiveOffloader | None = None
    context: Callable[[], AbstractContextManager] | None = None  # wraps forward (save_on_cpu)
    times: list[float] = field(default_factory=list)
    stats: list[dict[str, float]] = field(default_factory=list)
    bitwise_equal: bool = True
    peaks: dict[str, int] = field(default_factory=dict)


class StepPeaks:
    """`RssAnon` over one step, sampled by `cpu_memory.PeakSampler`: the value `before`, the peak up to
    the loss (`forward_peak`), what is held once the forward's copies finished, and the step's `peak`."""

    def __init__(self, interval_s: float) -> None:
        self._sampler = PeakSampler(rss_anon_bytes, interval_s=interval_s)
        self.before = self.forward_peak = self.held_after_forward = self.peak = self._sampler.reset()

    def split(self) -> None:
        """End of forward: keep the peak so far as `forward_peak`."""
        self.forward_peak = self._sampler.peak()

    def forward_end(self, acc: Accelerator) -> None:
        """Once the forward's copies finished: what the device still holds (`held_after_forward`)."""
        acc.synchronize()
        self.held_after_forward = self._sampler.read()

    def finish(self) -> None:
        """Stop sampling; `peak` includes a last reading."""
        self.peak = self._sampler.peak()
        self._sampler.stop()


def build_model(args: argparse.Namespace) -> InternLM2:
    """The benchmark model, seeded so every configuration starts from the same weights."""
    torch.manual_seed(0)
    model = InternLM2(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_kv_attention_heads=args.heads,
        vocab_size=VOCAB,
    )
    return model.to(DTYPES[args.dtype])


def make_cases(args: argparse.Namespace, acc: Accelerator) -> list[Case]:
    """Baseline, full and selective checkpointing of every block, sync and async offload of N blocks."""
    cases = [Case("baseline", 0, build_model(args))]
    for name, selective in (("full_ckpt", False), ("selective_ckpt", True)):
        cases.append(Case(name, args.layers, build_model(args)))
        apply_activation_checkpointing(cases[-1].model.layers, range(args.layers), selective=selective)
    for mode in ("sync", "async"):
        for n in (n for n in OFFLOAD_LAYERS if n < args.layers):
            cases.append(Case(f"offload_{mode}_{n}", n, build_model(args)))
            cases[-1].handle = offload_layers(cases[-1].model.layers, n, mode=mode, accelerator=acc)
        # selective checkpointing with host-offloaded outputs, on as many blocks as the deepest block offload
        n = max(n for n in OFFLOAD_LAYERS if n < args.layers)
        cases.append(Case(f"selective_offload_{mode}_{n}", n, build_model(args)))
        cases[-1].handle = apply_selective_offload(cases[-1].model.layers, range(n), accelerator=acc, mode=mode)
    cases.append(Case("save_on_cpu", args.layers, build_model(args), context=lambda: save_on_cpu(acc)))
    return cases


def handle_stats(handle: ActivationOffloader | SelectiveOffloader | None) -> dict[str, float]:
    """The offload's byte and time counters of the last step (empty without one), without their metrics prefix."""
    if handle is None:
        return {}
    prefix = "act_offload_" if isinstance(handle, ActivationOffloader) else "sc_offload_"
    return {key.removeprefix(prefix): value for key, value in handle.metrics().items()}


def save_on_cpu(acc: Accelerator) -> AbstractContextManager:
    """torch's `save_on_cpu(pin_memory=True)`: every saved tensor copied to a new host tensor, synchronously.

    Where pinned memory cannot exist (cpu), the same allocate-and-copy per saved tensor goes to the host
    tier, which is what `save_on_cpu` does there apart from the pinning (without it, it copies nothing).
    """
    if acc.supports_pinned_memory:
        return torch.autograd.graph.save_on_cpu(pin_memory=True)

    def pack(t: torch.Tensor) -> torch.Tensor:
        host = acc.host_empty(t.shape, t.dtype, pinned=False)
        host.copy_(t)
        return host

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda host: host)


def step(case: Case, tokens: torch.Tensor, acc: Accelerator, sampler: StepPeaks | None = None) -> float:
    """Forward + backward of one batch; returns the seconds it took."""
    start = time.perf_counter()
    with case.context() if case.context is not None else suppress():
        logits = case.model(tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    if sampler is not None:
        sampler.split()
        sampler.forward_end(acc)
    loss.backward()
    acc.synchronize()
    return time.perf_counter() - start


def check_and_clear(case: Case, reference: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """Compare this step's grads with the baseline's (bitwise), then drop them; returns the grads."""
    grads = [p.grad for p in case.model.parameters()]
    if reference is not None:
        case.bitwise_equal &= all(torch.equal(g, r) for g, r in zip(grads, reference, strict=True))
    case.model.zero_grad(set_to_none=True)
    return grads


def warm_up(cases: list[Case], tokens: torch.Tensor, acc: Accelerator) -> list[torch.Tensor]:
    """One untimed step per configuration, baseline first; returns the baseline's grads (the reference)."""
    reference: list[torch.Tensor] = []
    for case in cases:
        step(case, tokens, acc)
        grads = check_and_clear(case, reference or None)
        reference = reference or grads
    return reference


def time_cases(cases: list[Case], tokens: torch.Tensor, args: argparse.Namespace, acc: Accelerator) -> None:
    """Warm-up, then timed steps, round-robin (rotating the start); checks every step's grads."""
    reference = warm_up(cases, tokens, acc)
    for rep in range(1, args.warmup + args.repeats):
        k = rep % len(cases)
        for case in cases[k:] + cases[:k]:
            seconds = step(case, tokens, acc)
            if rep >= args.warmup:
                case.times.append(seconds)
                case.stats.append(handle_stats(case.handle))
            check_and_clear(case, reference)


def measure_peaks(cases: list[Case], tokens: torch.Tensor, interval_s: float, acc: Accelerator) -> dict[str, Any]:
    """Memory pass: a warm-up step each, then one sampled step each; peak `RssAnon` minus the value before."""
    reference = warm_up(cases, tokens, acc)
    for case in cases:
        gc.collect()
        with suppress(OSError, AttributeError):  # freed heap pages back to the OS (glibc): a clean `before`
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        sampler = StepPeaks(interval_s)
        step(case, tokens, acc, sampler)
        sampler.finish()
        check_and_clear(case, reference)
        fwd, whole = sampler.forward_peak - sampler.before, sampler.peak - sampler.before
        held = sampler.held_after_forward - sampler.before
        case.peaks = {"forward": fwd, "step": whole, "held_after_forward": held, "bitwise_equal": case.bitwise_equal}
    return {case.name: case.peaks for case in cases}


def sampled_peaks(argv: list[str]) -> dict[str, Any]:
    """Run the memory pass of the same configurations in a fresh process with a fixed glibc mmap threshold."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peaks.json"
        cmd = [sys.executable, "-m", MODULE, *argv, "--memory-pass", "--out", str(out)]
        subprocess.run(cmd, env=env, check=True)
        return json.loads(out.read_text())


def summarize(case: Case, base: Case) -> dict[str, Any]:
    """The JSON record of one configuration; the min is the step least disturbed by other processes."""
    median, fastest = statistics.median(case.times), min(case.times)
    record: dict[str, Any] = {
        "name": case.name,
        "num_layers": case.num_layers,
        "step_s": case.times,
        "step_s_median": median,
        "ratio": median / statistics.median(base.times),
        "step_s_min": fastest,
        "ratio_min": fastest / min(base.times),
        "peak_rss_anon_delta_bytes": case.peaks["step"],
        "forward_peak_rss_anon_delta_bytes": case.peaks["forward"],
        "bitwise_equal": case.bitwise_equal and case.peaks["bitwise_equal"],
        "offloader": None,
    }
    if case.handle is not None:
        # Byte counts are the same every step; times are medians over the timed steps.
        record["offloader"] = {k: statistics.median(s[k] for s in case.stats) for k in case.stats[-1]}
        copies = record["offloader"]["d2h_s"] + record["offloader"]["h2d_s"]
        # Share of the copies' own time that compute did not wait for (async: the overlap achieved).
        overlapping = copies and case.handle.copies.d2h is not None  # sync copies run on the compute stream itself
        record["copy_overlap"] = 1 - record["offloader"]["wait_s"] / copies if overlapping else None
    if isinstance(case.handle, ActivationOffloader):
        # Of the bytes copied to the host (each storage once), how many the device no longer holds once
        # forward's copies finished, against the baseline at the same point (Megatron reports 99.84-100 %).
        freed = base.peaks["held_after_forward"] - case.peaks["held_after_forward"]
        record["freed_fraction"] = freed / max(1, record["offloader"]["host_bytes"])
    return record


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """What the numbers depend on: versions, threads, cores, sizes, host tier, allocator setting."""
    return {
        **machine(),
        "shm_dir": host_alloc.SHM_DIR,
        "shm_writable": os.access(host_alloc.SHM_DIR, os.W_OK),
        "memory_pass_malloc_mmap_threshold": MMAP_THRESHOLD,
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "vocab": VOCAB},
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "sample_interval_s": args.sample_interval,
    }


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Step time ratio against peak `RssAnon` delta, one labelled point per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, rec in enumerate(records):
        x, y = rec["peak_rss_anon_delta_bytes"] / 2**20, rec["ratio"]
        ax.scatter(x, y, color="tab:blue" if rec["bitwise_equal"] else "tab:red")
        ax.annotate(rec["name"], (x, y), textcoords="offset points", xytext=(4, 4 - 14 * (i % 2)), fontsize=8)
    ax.set(xlabel="peak RssAnon in forward+backward minus before (MiB)", ylabel="median step time / baseline")
    ax.set_title("Activation memory vs step time on cpu (red: grads differ from baseline)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options; `--quick` gives tiny defaults (for tests), explicit flags still win."""
    p = argparse.ArgumentParser(prog="python -m internlm_offload.bench.activation", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--sample-interval", type=float, default=0.001, help="RssAnon sampling period (s)")
    p.add_argument("--memory-pass", action="store_true", help=argparse.SUPPRESS)  # the child process
    add_timing_arguments(p, out="bench_results/activation.json", repeats=5, unit="configuration")
    return parse_timing_arguments(p, argv, QUICK)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Time every configuration, sample its memory in a child process, write JSON + PNG, print a table."""
    args = parse_args(argv)
    acc = Accelerator("cpu")
    cases = make_cases(args, acc)
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    try:
        if args.memory_pass:
            peaks = measure_peaks(cases, tokens, args.sample_interval, acc)
            args.out.write_text(json.dumps(peaks))
            return peaks
        time_cases(cases, tokens, args, acc)
    finally:
        for case in cases:
            if case.handle is not None:
                case.handle.close()
    peaks = sampled_peaks(sys.argv[1:] if argv is None else argv)
    for case in cases:
        case.peaks = peaks[case.name]
    result = {"env": environment(args), "results": [summarize(c, cases[0]) for c in cases]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result["results"], args.out.with_suffix(".png"))
    print_table(result["results"])
    return result


def print_table(records: list[dict[str, Any]]) -> None:
    """The summary on stdout, one line per configuration (memory in MiB)."""
    head = ("median s", "ratio", "min s", "ratio", "fwd MiB", "step MiB", "offl MiB", "freed", "overlap")
    print(f"{'config':<26}" + "".join(f"{h:>{len(h) + 1}}" for h in head) + "  bitwise")
    for rec in records:
        mib = [rec[k] / 2**20 for k in ("forward_peak_rss_anon_delta_bytes", "peak_rss_anon_delta_bytes")]
        mib.append((rec["offloader"] or {}).get("offloaded_bytes", 0) / 2**20)
        cells = [rec[k] for k in ("step_s_median", "ratio", "step_s_min", "ratio_min")] + mib
        cells.append(rec.get("freed_fraction", float("nan")))
        cells.append(rec.get("copy_overlap") if rec.get("copy_overlap") is not None else float("nan"))
        row = "".join(f"{v:>{len(h) + 1}.2f}" for h, v in zip(head, cells, strict=True))
        print(f"{rec['name']:<26}{row}  {rec['bitwise_equal']}")


if __name__ == "__main__":
    main()
