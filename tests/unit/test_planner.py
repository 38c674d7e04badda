"""The memory planner's trace: meta tensors through the builder's wiring predict a real cpu step's memory."""

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.planner import cost
from internlm_offload.planner.standins import PlanningAccelerator, flash_attention_on_meta
from internlm_offload.planner.trace import trace_step

# the feature and work tests trace the configs the real-step tests trace: each traced once (CI time)
pytestmark = pytest.mark.usefixtures("shared_traces")
from internlm_offload.planner.tracker import StorageTracker

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SMALL = {"data.seq_len": 64, "data.micro_bsz": 2, "data.micro_num": 2, "data.global_bsz": 4}
BF16 = {"model.dtype": "torch.bfloat16"}
CASES = {
    "baseline": ("internlm2_tiny.py", {}),
    "act_offload": ("internlm2_tiny_act_offload.py", {}),
    "ckpt_offload": ("internlm2_tiny_ckpt_offload.py", {}),
    "swap": ("internlm2_tiny_swap.py", {}),
    "hybrid": ("internlm2_tiny_hybrid.py", {}),
    "all": ("internlm2_tiny_all_offload.py", {}),
    "bf16": ("internlm2_tiny.py", BF16),
    "bf16_swap": ("internlm2_tiny_swap.py", BF16),
    "bf16_hybrid_all": ("internlm2_tiny_hybrid.py", {**BF16, "cpu_offloading.enable": True, "model.checkpoint": 0.5}),
    "bf16_swap_grads": ("internlm2_tiny_swap.py", {**BF16, "grad_offload": True, "grad_offload_bucket_mb": 0.25}),
    "hybrid_grads": ("internlm2_tiny_hybrid.py", {"hybrid_optimizer.offload_fraction": 1.0, "grad_offload": True}),
}


def config(name: str, **extra):
    file, options = CASES[name]
    return resolve_config(load_config_file(CONFIGS / file, {**SMALL, **options, **extra}))


@pytest.mark.parametrize("name", CASES)
def test_meta_trace_predicts_the_real_step(name):
    """The same steps run for real on cpu tensors, counted the same way: peaks within 0.1 %, every
    component within 64 KiB (a few scalars live on the host in the real run and on meta in the trace),
    the per-block figures exactly."""
    cfg = config(name)
    predicted, measured = trace_step(cfg), trace_step(cfg, measure=True)
    for key in ("device_peak_bytes", "host_peak_bytes", "first_step_device_peak_bytes"):
        assert predicted.as_dict()[key] == pytest.approx(measured.as_dict()[key], rel=1e-3, abs=64 << 10), key
    for key, value in measured.components.items():
        assert abs(predicted.components[key] - value) <= 64 << 10, (key, predicted.components[key], value)
    assert predicted.block_activation_bytes == measured.block_activation_bytes


def test_each_feature_moves_its_component():
    """Swap moves the states to the host, offload and checkpointing shrink the activations, bf16 with
    masters halves the params and adds fp32 masters, hybrid splits the states, DDP adds its buckets."""
    base = trace_step(config("baseline")).components
    params = base["model_params"]
    # AdamW: exp_avg and exp_avg_sq per param, and a 4-byte step per tensor (fused keeps it on the device)
    assert base["optimizer_states"] == pytest.approx(2 * params, rel=0.01) and base["host_optimizer_states"] == 0

    swap = trace_step(config("swap")).components
    assert swap["optimizer_states"] == 0 and swap["host_optimizer_states"] == pytest.approx(2 * params, rel=0.01)

    offload = trace_step(config("act_offload")).components
    assert offload["activations"] < base["activations"] / 2 and offload["host_buffers"] > 0
    checkpointed = trace_step(config("baseline", **{"model.checkpoint": 1.0})).components
    assert checkpointed["activations"] < base["activations"] / 2 and checkpointed["host_buffers"] == 0

    bf16 = trace_step(config("bf16")).components
    assert bf16["model_params"] == params // 2 and bf16["master_weights"] == params

    hybrid = trace_step(config("hybrid")).components
    assert 0 < hybrid["host_optimizer_states"] and hybrid["optimizer_states"] + hybrid["host_optimizer_states"] == (
        pytest.approx(2 * params, rel=0.01)
    )

    ddp = trace_step(config("baseline", **{"parallel.mode": "ddp"})).components
    assert ddp["ddp_buckets"] == params


def fsdp2(name: str, world_size: int, **extra):
    """A case under FSDP2 on `world_size` ranks, each rank with the single-process batch shape."""
    options = {"parallel.mode": "fsdp2", "data.global_bsz": SMALL["data.global_bsz"] * world_size, **extra}
    file, case_options = CASES[name]
    return resolve_config(load_config_file(CONFIGS / file, {**SMALL, **case_options, **options}), world_size=world_size)


@pytest.mark.parametrize(
    "name, world_size", [("baseline", 2), ("all", 2), ("bf16_hybrid_all", 4), ("bf16_swap", 8), ("bf16_swap_grads", 2)]
)
def test_fsdp2_meta_trace_predicts_the_real_step(name, world_size):
    """FSDP2 on meta tensors (its device assumptions stood in) against the same steps on real cpu tensors over
    the same fake process group: rank 0's peaks and components agree as in the single-process test."""
    cfg = fsdp2(name, world_size)
    predicted, measured = trace_step(cfg, world_size), trace_step(cfg, world_size, measure=True)
    for key in ("device_peak_bytes", "host_peak_bytes", "first_step_device_peak_bytes"):
        assert predicted.as_dict()[key] == pytest.approx(measured.as_dict()[key], rel=1e-3, abs=64 << 10), key
    for key, value in measured.components.items():
        assert abs(predicted.components[key] - value) <= 64 << 10, (key, predicted.components[key], value)


def test_fsdp2_divides_the_model_state_over_the_ranks():
    """Params, states and the grads the step reads shrink with the ranks (dim-0 padding aside); the
    activations of a rank's micro-batch do not; nothing parameter-sized stays alive between steps."""
    single_trace = trace_step(config("baseline"))
    single = single_trace.components
    for world_size in (1, 2, 8):  # one rank still builds a device mesh: the trace brings a fake group of one
        sharded_trace = trace_step(fsdp2("baseline", world_size), world_size)
        sharded = sharded_trace.components
        # Per block: what its forward leaves alive, not the gathered params it reshards (once -1.5 MiB here).
        assert sharded_trace.block_activation_bytes == single_trace.block_activation_bytes
        for name in ("model_params", "optimizer_states", "gradients_at_step"):
            assert sharded[name] == pytest.approx(single[name] / world_size, rel=0.05), (world_size, name)
        # FSDP2's root all-gather and the blocks' reshards move parameter-sized buffers across the forward's
        # edges, which the activations figure (live bytes the forward leaves) sees: close, not equal.
        assert sharded["activations"] == pytest.approx(single["activations"], rel=0.1)
        assert sharded["other_at_rest"] < single["model_params"] / 64


@pytest.mark.parametrize("world_size", [1, 2])
def test_fsdp2_cpu_offload_policy_moves_the_model_state_to_the_host(world_size):
    """FSDP2's CPUOffloadPolicy: the shards (fp32 masters under bf16), their gradients and the optimizer's
    states are host memory; the device keeps the activations and, one block at a time, the all-gathered
    parameters with the device copies of their shards."""
    on_device = trace_step(fsdp2("bf16", world_size), world_size)
    offloaded = trace_step(fsdp2("bf16", world_size, **{"parallel.fsdp_cpu_offload": True}), world_size)
    device, host = on_device.components, offloaded.components
    assert host["model_params"] == 0 and host["optimizer_states"] < 1024  # AdamW's step counters: factories
    assert host["host_params"] == device["model_params"] > 0
    assert host["host_optimizer_states"] > 0
    assert host["host_optimizer_states"] == pytest.approx(device["optimizer_states"], abs=1024)
    assert host["pinned_host_peak"] >= host["host_params"]
    # Every gradient shard is copied to the host: the host peak holds it beside the shards and the states.
    assert offloaded.host_peak_bytes >= host["host_params"] + host["host_optimizer_states"] + host["gradients_at_step"]
    assert host["activations"] == pytest.approx(device["activations"], rel=0.01)
    saved = device["model_params"] + device["optimizer_states"] + device["gradients_at_step"]
    assert offloaded.device_peak_bytes <= on_device.device_peak_bytes - saved / 2


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("masked", [False, True])
def test_attention_stand_in_is_the_kernel_cpu_picks(masked):
    """Real cpu SDPA (GQA, causal or a document mask) runs the flash kernel; on meta the stand-in runs it too,
    and saves far less than meta's own math path would (the (T x T) scores)."""
    q, kv = torch.randn(2, 4, 64, 16), torch.randn(2, 2, 64, 16)
    mask = torch.ones(2, 1, 64, 64, dtype=torch.bool).tril() if masked else None
    kwargs = dict(attn_mask=mask, is_causal=not masked, enable_gqa=True)
    with _Ops() as real:
        F.scaled_dot_product_attention(q, kv, kv, **kwargs)
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in real.names

    def saved_bytes(stand_in: bool) -> int:
        meta = [t.to("meta").requires_grad_() for t in (q, kv, kv)]
        tracker = StorageTracker()
        with flash_attention_on_meta() if stand_in else torch.device("meta"), tracker:
            out = F.scaled_dot_product_attention(
                *meta, **{**kwargs, "attn_mask": None if mask is None else mask.to("meta")}
            )
            return tracker.live_bytes("device")

    assert saved_bytes(stand_in=True) * 2 < saved_bytes(stand_in=False)


def test_tracker_counts_a_storage_once_and_frees_it_with_its_last_view():
    tracker = StorageTracker()
    with tracker:
        a = torch.empty(1024, device="meta")
        views = [a[:10], a.view(32, 32)]
        assert tracker.live_bytes("device") == 4096
        del a
        assert tracker.live_bytes("device") == 4096  # the views keep it
        views.clear()
    assert tracker.live_bytes("device") == 0 and tracker.peak_bytes("device") == 4096


def test_tracker_counts_a_dtensor_by_its_local_shard_and_follows_resizes():
    """A DTensor's own storage reports the global size; FSDP2 frees and refills storages with resize_."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from internlm_offload.planner.trace import fake_process_group

    tracker = StorageTracker()
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (4,))
        with tracker, tracker.counting_resizes():
            shard = torch.empty(16, 16, device="meta")
            whole = DTensor.from_local(shard, mesh, [Shard(0)], run_check=False) * 2  # a new (64, 16) DTensor
            assert whole.shape == (64, 16) and tracker.live_bytes("device") == 2 * 1024
            whole.to_local().untyped_storage().resize_(0)
            assert tracker.live_bytes("device") == 1024
            whole.to_local().untyped_storage().resize_(1024)
            assert tracker.live_bytes("device") == 2 * 1024


def test_storages_derived_from_host_tensors_are_host_memory():
    """A CPU optimizer's states (zeros_like of a host master) count on the host, a device copy on the device."""
    acc = PlanningAccelerator("cpu")
    with acc.tracker:
        master = acc.host_empty((256,), torch.float32, pinned=True)
        state = torch.zeros_like(master)
        on_device = torch.empty(256, device=acc.device())
        on_device.copy_(master)
        mixed = master + on_device
    assert acc.tracker.tier_of(state) == "host" and acc.tracker.tier_of(mixed) == "device"
    assert acc.tracker.live_bytes("host") == 2048 and acc.tracker.live_bytes("pinned") == 1024
    assert acc.tracker.live_bytes("device") == 2048


def test_traced_work_counts_what_each_feature_moves_and_computes():
    """FLOPs do not change with offload and grow by about a forward with full checkpointing; swap moves its
    states in and out once per step; activation offload moves what it parks each micro-batch; the hybrid
    steps its CPU share on the host."""
    base = trace_step(config("baseline"))
    swap = trace_step(config("swap"))
    offload = trace_step(config("act_offload"))
    hybrid = trace_step(config("hybrid"))
    checkpointed = trace_step(config("baseline", **{"model.checkpoint": 1.0}))
    flops = base.micro_batch_work.flops
    assert swap.micro_batch_work.flops == offload.micro_batch_work.flops == flops
    assert 1.2 * flops < checkpointed.micro_batch_work.flops < 1.4 * flops  # + one forward of 4 blocks (not the head)
    states = swap.components["host_optimizer_states"]
    assert (
        swap.optimizer_work.h2d_bytes == swap.optimizer_work.d2h_bytes
        and 0.99 * states <= swap.optimizer_work.h2d_bytes <= states
    )
    assert base.optimizer_work.h2d_bytes == base.micro_batch_work.d2h_bytes == 0
    assert (
        offload.micro_batch_work.d2h_bytes == offload.micro_batch_work.h2d_bytes == offload.components["host_buffers"]
    )
    elements = base.optimizer_work.device_adamw_elements
    assert hybrid.optimizer_work.host_adamw_elements + hybrid.optimizer_work.device_adamw_elements == elements
    assert 0.45 * elements < hybrid.optimizer_work.host_adamw_elements <= 0.5 * elements


def test_gradient_offload_moves_the_gradients_to_the_host_during_backward():
    """bf16 swap: the fp32 master gradients leave the device (and the step's peak) for host memory; each
    micro-batch copies its bf16 gradients out, and the step no longer copies fp32 gradients."""
    kept = trace_step(config("bf16_swap"))
    offloaded = trace_step(config("bf16_swap_grads"))
    params = kept.components["model_params"]  # bf16
    assert kept.components["gradients_at_step"] == 2 * params and offloaded.components["gradients_at_step"] == 0
    # the swap chunks now carry their gradients: 1 / swap_optimizer_times (4) of them is on the device at a time
    assert offloaded.device_peak_bytes <= kept.device_peak_bytes - 2 * params * 3 // 4
    host_grads = offloaded.components["host_buffers"] - kept.components["host_buffers"]
    assert 2 * params <= host_grads <= 2 * params + 2 * (1 << 20)  # fp32 grads + two staging buffers
    assert offloaded.micro_batch_work.d2h_bytes == params and kept.micro_batch_work.d2h_bytes == 0
    # the host adds read and write the fp32 sum and read the bf16 gradient: 10 bytes per element
    assert offloaded.micro_batch_work.host_add_bytes == 5 * params and kept.micro_batch_work.host_add_bytes == 0


def test_step_time_model():
    """micro_num x max(compute, activation copies, host adds) + max(device update, host update) + optimizer copies
    (the larger direction on a device, both on cpu)."""
    hw = cost.Hardware(
        "x", flops_per_s=1e12, link_bytes_per_s=1e9, hbm_bytes_per_s=28e9, cpu_adam_elements_per_s=1e8, source="test"
    )
    micro = cost.StepWork(flops=2e12, h2d_bytes=1e9, d2h_bytes=2e9)  # compute 2 s, copies 3 s
    optimizer = cost.StepWork(h2d_bytes=5e8, d2h_bytes=5e8, device_adamw_elements=1e9, host_adamw_elements=2e8)
    timing = cost.step_time(micro, optimizer, micro_num=4, hw=hw)
    # a device's link copies both ways at once: the optimizer's 0.5 s in and 0.5 s out take 0.5 s
    assert timing.micro_batch_s == 3.0 and timing.optimizer_s == 2.0 + 0.5 and timing.step_s == 14.5
    one_way = dataclasses.replace(hw, duplex_link=False)  # cpu: both directions share one memory bus
    assert cost.step_time(micro, optimizer, micro_num=4, hw=one_way).optimizer_s == 2.0 + 1.0
    # host adds at the AdamW row's host bandwidth (1e8 elements/s x 28 B): 11.2e9 bytes take 4 s, the longest
    micro.host_add_bytes = int(11.2e9)
    assert cost.step_time(micro, optimizer, micro_num=4, hw=hw).micro_batch_s == pytest.approx(4.0)


def test_calibrate_measures_this_machine():
    row = cost.calibrate(repeats=1)
    assert row.flops_per_s > 1e8 and row.link_bytes_per_s > 1e8 and row.cpu_adam_elements_per_s > 1e6
    assert row.source.startswith("measured") and not row.duplex_link  # cpu: memcpy both ways over one bus
