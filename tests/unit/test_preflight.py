"""Preflight: a run whose predicted memory exceeds the machine stops with one line before allocating."""

from pathlib import Path

import pytest

from internlm_offload.config import ConfigError, load_config_file, resolve_config
from internlm_offload.planner import preflight
from internlm_offload.planner.trace import trace_step

TINY = Path(__file__).resolve().parents[2] / "configs" / "internlm2_tiny.py"
SMALL = {"data.seq_len": 64, "data.micro_bsz": 2, "data.micro_num": 2, "data.global_bsz": 4}


def config(**options):
    return resolve_config(load_config_file(TINY, {**SMALL, **options}))


def check(cfg, **kwargs):
    args = dict(world_size=1, local_world_size=1, device_total=None, config_path="x.py") | kwargs
    return preflight.check_fits(cfg, **args)


def test_a_device_smaller_than_the_peak_is_refused_naming_what_dominates():
    cfg = config()
    memory = trace_step(cfg)
    peak = memory.device_peak_bytes
    device = {n: v for n, v in memory.components.items() if not n.startswith(("host_", "pinned_", "gradients_"))}
    largest = max(device, key=device.get)
    assert check(cfg, device_total=peak).device_peak == peak
    with pytest.raises(preflight.PreflightError) as err:
        check(cfg, device_total=peak - 1)
    message = str(err.value)
    assert isinstance(err.value, ConfigError) and "\n" not in message  # exit 2, one line
    assert "predicted device peak" in message and f"largest: {largest}" in message
    assert preflight.REMEDIES.get(largest, preflight.DEFAULT_REMEDY) in message


def test_on_cpu_device_and_host_peaks_share_the_host(monkeypatch):
    cfg = config(swap_optimizer=True)
    memory = trace_step(cfg)
    both = memory.device_peak_bytes + memory.host_peak_bytes
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: both)
    check(cfg)
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: both - 1)
    with pytest.raises(preflight.PreflightError, match=r"per process \(device .* \+ host"):
        check(cfg)
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: 2 * both)
    with pytest.raises(preflight.PreflightError, match="available per local rank"):
        check(cfg, device_total=10**12, local_world_size=64)  # host: 64 ranks share it


def test_fsdp2_is_checked_with_this_ranks_trace():
    """FSDP2 over 4 ranks is traced as rank 0 of 4: the prediction is that trace, smaller than one process's."""
    cfg = config(**{"parallel.mode": "fsdp2", "data.global_bsz": 16})
    prediction = preflight.predict(cfg, world_size=4)
    assert prediction.device_peak == trace_step(cfg, 4).device_peak_bytes
    assert prediction.device_peak < trace_step(config()).device_peak_bytes


def test_memory_in_use_before_the_run_counts_against_the_device():
    """The traced peak holds the run's tensors; what is in use on the device before the run (the context)
    comes on top."""
    cfg = config()
    peak = trace_step(cfg).device_peak_bytes
    check(cfg, device_total=peak + 4096, runtime_bytes=4096)
    with pytest.raises(preflight.PreflightError, match=r"\+ 4.0 KiB in use before the run, the device has"):
        check(cfg, device_total=peak + 4096, runtime_bytes=4097)
