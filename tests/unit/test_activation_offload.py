"""Activation offload is byte transport: losses, logits and grads are bitwise those of no offload."""

import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from stream_gates import held_back

from internlm_offload.device import Accelerator
from internlm_offload.model import InternLM2
from internlm_offload.offload import apply_activation_checkpointing, make_layer_plan
from internlm_offload.offload.activation import mark_not_offload, no_offload, offload_layers
from internlm_offload.offload.plan import LayerMode

L = 4


def tiny_model() -> InternLM2:
    torch.manual_seed(0)
    return InternLM2(num_layers=L, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=259)


def batches(micro_num: int, seq_len: int = 32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 259, (2, seq_len + 1), generator=g) for _ in range(micro_num)]


def step(model: nn.Module, micro_num: int = 1, seq_len: int = 32):
    """Gradient accumulation over `micro_num` micro-batches; returns losses, last logits, grads."""
    losses, logits = [], None
    for tokens in batches(micro_num, seq_len):
        logits = model(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) / micro_num
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return torch.stack(losses), logits.detach(), grads


def assert_bitwise(got, expected) -> None:
    assert torch.equal(got[0], expected[0]), "loss"
    assert torch.equal(got[1], expected[1]), "logits"
    for name, grad in expected[2].items():
        assert torch.equal(got[2][name], grad), name


def planned_model(num_offload: int, ratio: float, selective: bool, mode: str):
    model = tiny_model()
    plan = make_layer_plan(L, offload_layers=num_offload, checkpoint_ratio=ratio, selective=selective)
    apply_activation_checkpointing(model.layers, plan.layers_with(LayerMode.CHECKPOINT), selective=False)
    apply_activation_checkpointing(model.layers, plan.layers_with(LayerMode.SELECTIVE), selective=True)
    return model, offload_layers(model.layers, num_offload, mode=mode)


@pytest.fixture(scope="module")
def baselines():
    return {micro_num: step(tiny_model(), micro_num) for micro_num in (1, 4)}


MATRIX = list(itertools.product([1, L // 2, L - 1], ["sync", "async"], [0.0, 0.5, 1.0], [False, True], [1, 4]))


@pytest.mark.parametrize("num_offload, mode, ratio, selective, micro_num", MATRIX)
def test_bitwise_alignment_matrix(baselines, num_offload, mode, ratio, selective, micro_num):
    model, handle = planned_model(num_offload, ratio, selective, mode)
    assert_bitwise(step(model, micro_num), baselines[micro_num])
    assert handle.metrics()["act_offload_offloaded_bytes"] > 0
    handle.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_saved_bytes_are_accounted_for(mode):
    """offloaded + resident == the saved bytes without offload; more offload, lower peak."""
    base_model = tiny_model()
    reference = offload_layers(base_model.layers, 0)
    step(base_model)
    total = reference.metrics()["act_offload_resident_bytes"]
    assert (
        reference.metrics()["act_offload_offloaded_bytes"] == 0
        and reference.metrics()["act_offload_peak_resident_bytes"] == total
    )
    peaks = []
    for n in range(1, L):
        model = tiny_model()
        handle = offload_layers(model.layers, n, mode=mode)
        step(model)
        stats = handle.metrics()
        assert stats["act_offload_offloaded_bytes"] + stats["act_offload_resident_bytes"] == total
        peaks.append(stats["act_offload_peak_resident_bytes"])
    assert total > peaks[0] > peaks[1] > peaks[2] - total // L  # offloading frees memory, roughly per block
    assert peaks[0] < total and peaks[1] < peaks[0]


class SavesViews(nn.Module):
    """Saves x, x.t(), x[:k] and x.view(-1) of one storage (elementwise products keep them all)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x @ self.w  # (16, 16), a fresh storage
        a = x * x  # saves x
        b = (x.t() * x.t()).t()  # saves x.t()
        c = x[:8] * x[:8]  # saves x[:8]
        d = (x.view(-1) * x.view(-1)).view(16, 16)  # saves x.view(-1)
        return a + b + torch.cat([c, c]) + d


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_each_storage_is_offloaded_once_and_views_reload_bitwise(mode):
    def run(offload: bool):
        torch.manual_seed(0)
        layers = nn.ModuleList([SavesViews(), SavesViews()])
        handle = offload_layers(layers, 1, mode=mode, min_offload_bytes=0) if offload else None
        x = torch.randn(16, 16, requires_grad=True)
        layers[1](layers[0](x)).sum().backward()
        return handle, x.grad, [p.grad for p in layers.parameters()]

    handle, x_grad, grads = run(True)
    _, base_x_grad, base_grads = run(False)
    assert torch.equal(x_grad, base_x_grad)
    assert all(torch.equal(g, b) for g, b in zip(grads, base_grads))
    stats = handle.metrics()
    # One host copy per storage: the block input (saved by the matmul) and x, although the four
    # products save x, x.t(), x[:8] and x.view(-1) twice each (both operands of a mul are saved).
    assert stats["act_offload_host_bytes"] == 2 * 16 * 16 * 4
    assert stats["act_offload_offloaded_bytes"] == 16 * 16 * 4 * (1 + 2 + 2 + 2) + 8 * 16 * 4 * 2


def test_parameters_small_and_marked_tensors_stay():
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64)])
    handle = offload_layers(layers, 1, mode="sync", min_offload_bytes=0)
    x = torch.randn(4, 64, requires_grad=True)
    y = layers[0](x)  # saves x (input) and the weight (a parameter): only x may go
    layers[1](y).sum().backward()
    assert handle.metrics()["act_offload_host_bytes"] == x.numel() * 4
    # marked and tiny tensors stay
    handle.close()
    handle = offload_layers(layers, 1, mode="sync", min_offload_bytes=10**9)
    layers[1](layers[0](x)).sum().backward()
    assert handle.metrics()["act_offload_offloaded_bytes"] == 0
    handle.close()
    handle = offload_layers(layers, 1, mode="sync", min_offload_bytes=0)
    mark_not_offload(x)
    layers[1](layers[0](x)).sum().backward()
    assert handle.metrics()["act_offload_offloaded_bytes"] == 0
    handle.close()


class KeepsRegion(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with no_offload():  # a region inside a block whose saved tensors stay on the device
            return super().forward(x)


def test_no_offload_region_inside_a_block():
    layers = nn.ModuleList([KeepsRegion(64, 64), nn.Linear(64, 64)])
    handle = offload_layers(layers, 1, mode="sync", min_offload_bytes=0)
    x = torch.randn(4, 64, requires_grad=True)
    layers[1](layers[0](x)).sum().backward()
    assert handle.metrics()["act_offload_offloaded_bytes"] == 0 and handle.metrics()["act_offload_resident_bytes"] > 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_lifecycle_edge_cases_leave_no_state(baselines, mode):
    model = tiny_model()
    handle = offload_layers(model.layers, 2, mode=mode)
    tokens = batches(1)[0]
    with torch.no_grad():
        model(tokens[:, :-1])  # no-grad forward in train mode
    model.eval()
    model(tokens[:, :-1]).logits.sum()  # eval forward with grad, never backpropagated
    model.train()
    model(tokens[:, :-1])  # forward never followed by backward
    with pytest.raises(RuntimeError, match="boom"):
        hook = model.layers[1].register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
        try:
            model(tokens[:, :-1])  # an exception in the middle of forward
        finally:
            hook.remove()
    assert not handle._hook_stack  # no saved-tensor hooks left installed
    model.zero_grad(set_to_none=True)
    assert_bitwise(step(model), baselines[1])
    handle.close()
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in model.layers)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_forwards_before_one_backward_and_retain_graph(mode):
    def run(offload: bool):
        model = tiny_model()
        handle = offload_layers(model.layers, 2, mode=mode) if offload else None
        first, second = batches(2)
        loss = sum(F.cross_entropy(model(t[:, :-1]).logits.flatten(0, 1), t[:, 1:].flatten()) for t in (first, second))
        loss.backward(retain_graph=True)
        loss.backward()  # the host copies are still there: a second backward reloads again
        return [p.grad for p in model.parameters()], handle

    grads, _ = run(True)
    base, _ = run(False)
    assert all(torch.equal(g, b) for g, b in zip(grads, base))


def test_host_buffers_are_reused_and_sequence_lengths_may_vary():
    model = tiny_model()
    handle = offload_layers(model.layers, 2, mode="async")
    step(model)
    step(model)
    allocated = handle.copies.pool.allocated_bytes
    step(model)
    assert handle.copies.pool.allocated_bytes == allocated  # steady state: no new host allocation
    model.zero_grad(set_to_none=True)
    short = step(model, seq_len=16)
    plain = tiny_model()
    assert_bitwise(short, step(plain, seq_len=16))


def test_remove_restores_the_layers(baselines):
    model = tiny_model()
    handle = offload_layers(model.layers, 3)
    handle.close()
    assert_bitwise(step(model), baselines[1])
    assert handle.metrics()["act_offload_offloaded_bytes"] == 0


@pytest.mark.parametrize(
    "bad",
    [dict(num_layers=L), dict(num_layers=-1), dict(mode="fast"), dict(min_offload_bytes=-1), dict(prefetch_layers=0)],
)
def test_bad_arguments(bad):
    kwargs = {"num_layers": 1, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        offload_layers(tiny_model().layers, kwargs.pop("num_layers"), **kwargs)


# ---------------------------------------------------------------------------- races on the cpu streams


def delayed_handle(model: InternLM2, delay_s: float):
    handle = offload_layers(model.layers, 3, mode="async", accelerator=Accelerator("cpu"))
    handle.copies.d2h.close()
    handle.copies.h2d.close()
    handle.copies.d2h_lane.stream = handle.accelerator.stream(delay_s=delay_s)  # injected copy latency
    handle.copies.h2d_lane.stream = handle.accelerator.stream(delay_s=delay_s)
    return handle


def test_schedule_is_correct_under_slow_copies(baselines):
    model = tiny_model()
    delayed_handle(model, 0.005)
    assert_bitwise(step(model), baselines[1])


def _forward_cut_short(model: InternLM2) -> None:
    """A forward that an exception ends right after block 1's hooks, its group's copies still queued."""
    hook = model.layers[1].register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        model(batches(1)[0][:, :-1])
    hook.remove()


def test_a_forward_cut_short_releases_its_sources_after_their_copies(baselines):
    """The next forward must not drop the cut-short forward's sources while their slow copies still read them."""
    model = tiny_model()
    delayed_handle(model, 0.05)
    _forward_cut_short(model)
    model.zero_grad(set_to_none=True)
    assert_bitwise(step(model), baselines[1])


def test_remove_after_a_forward_cut_short_waits_for_its_copies():
    model = tiny_model()
    handle = delayed_handle(model, 0.05)
    _forward_cut_short(model)
    handle.close()  # raises StreamError if the sources went before their copies ran
    assert handle._forward is None


def test_dropping_the_reload_wait_is_caught(baselines):
    """Without the wait before use, backward reads reload buffers the held-back copies have not filled.

    With the wait in place, backward would block until the gate's timeout and then be bitwise."""
    model = tiny_model()
    handle = offload_layers(model.layers, 3, mode="async", accelerator=Accelerator("cpu"))
    handle._ensure_reloaded = handle._start_reload  # the bug: use the reload without waiting for it
    gate = held_back(handle.copies.h2d)
    got = step(model)
    gate.set()
    handle.copies.h2d.synchronize()
    assert not all(torch.equal(got[2][n], g) for n, g in baselines[1][2].items())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_checkpointing_stays_effective_beside_offload(mode):
    """Regression: the offloader's hooks must not swallow what checkpointed blocks save."""
    resident = {}
    for ratio in (0.0, 1.0):
        model, handle = planned_model(1, ratio, False, mode)
        step(model)
        resident[ratio] = handle.metrics()["act_offload_resident_bytes"]
        handle.close()
    # blocks 1-3 checkpointed: autograd keeps (almost) nothing of them, so far fewer resident bytes
    assert resident[1.0] < resident[0.0] / 4


class SavesTwo(nn.Module):
    """Saves exactly two distinct storages of the input's size: its input (sin) and `h` (cos)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        return h.cos()


@pytest.mark.parametrize(
    "mode, prefetch, expected_groups",
    [
        ("async", 1, 2),  # forward: the running block + the previous one in flight; backward: in use + 1 ahead
        ("async", 2, 3),  # backward: in use + 2 ahead
        ("sync", 1, 2),  # forward: only the running block; backward: in use + 1 ahead
    ],
)
def test_peak_resident_matches_the_plan(mode, prefetch, expected_groups):
    """5 blocks, 4 offloaded, 1 resident: the peak is set by the groups in flight, as the schedule says."""
    layers = nn.ModuleList([SavesTwo() for _ in range(5)])
    handle = offload_layers(layers, 4, mode=mode, prefetch_layers=prefetch, min_offload_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    h = x
    for layer in layers:
        h = layer(h)
    h.sum().backward()
    block = 2 * x.numel() * 4  # two saved storages per block
    stats = handle.metrics()
    assert stats["act_offload_resident_bytes"] == block and stats["act_offload_offloaded_bytes"] == 4 * block
    assert stats["act_offload_peak_resident_bytes"] == expected_groups * block
    # nothing left in the offloader between steps
    assert handle._stats.in_flight_bytes == 0 and handle._stats.live_resident_bytes == 0
    assert handle._forward is None and not handle._hook_stack


def _unconsumed_prefetch(handle, model: InternLM2) -> None:
    """Backward over layer 2's parameters only: it prefetches group 1 and never reads it."""
    tokens = batches(1)[0]
    loss = F.cross_entropy(model(tokens[:, :-1]).logits.flatten(0, 1), tokens[:, 1:].flatten())
    torch.autograd.grad(loss, list(model.layers[2].parameters()))


def test_every_reload_destination_is_recorded_on_the_copy_stream(monkeypatch):
    model = tiny_model()
    handle = offload_layers(model.layers, 3, mode="async", accelerator=Accelerator("cpu"))
    recorded = []
    monkeypatch.setattr(Accelerator, "record_stream", lambda self, t, s: recorded.append((t.data_ptr(), s)))
    _unconsumed_prefetch(handle, model)
    assert recorded and all(s is handle.copies.h2d for _, s in recorded)
    assert handle.metrics()["act_offload_offloaded_bytes"] > 0


def test_a_partial_backward_frees_the_graph_and_returns_every_host_buffer():
    """autograd.grad over one block's parameters leaves the rest of the graph unexecuted; it must still die."""
    import gc

    model = tiny_model()
    handle = offload_layers(model.layers, 3, mode="async", accelerator=Accelerator("cpu"))
    _unconsumed_prefetch(handle, model)
    gc.collect()
    pooled = sum(buf.numel() for bucket in handle.copies.pool.free.values() for buf, _ in bucket)
    assert handle.copies.pool.allocated_bytes > 0 and pooled == handle.copies.pool.allocated_bytes


def test_a_host_buffer_is_not_reused_while_an_unconsumed_prefetch_reads_it():
    model = tiny_model()
    handle = delayed_handle(model, 0.05)
    in_flight: set[int] = set()
    timer = handle.copies.h2d_lane._timer
    run, take = timer.run, handle.copies.pool.take

    def tracked_run(stream, copy, dsts, srcs, **kwargs):
        sources = {src.data_ptr() for src in srcs}
        in_flight.update(sources)

        def tracked_copy(dsts, srcs, **kwargs):
            copy(dsts, srcs, **kwargs)
            in_flight.difference_update(sources)

        run(stream, tracked_copy, dsts, srcs, **kwargs)

    handed_out_busy = []

    def checked_take(nbytes):
        buffer = take(nbytes)
        handed_out_busy.append(buffer.data_ptr() in in_flight)
        return buffer

    timer.run, handle.copies.pool.take = tracked_run, checked_take
    _unconsumed_prefetch(handle, model)
    assert in_flight, "the scenario must leave a prefetch in flight"
    handed_out_busy.clear()
    step(model)  # the next forward takes the returned buffers from the pool
    assert len(handed_out_busy) > 10 and not any(handed_out_busy)


class _PinnableCpu(Accelerator):
    """The cpu backend, reporting pinned-memory support like cuda does (to exercise that branch)."""

    @property
    def supports_pinned_memory(self) -> bool:
        return True


def test_unpinned_buffers_copy_blocking_and_async_says_so(caplog):
    model = tiny_model()
    with caplog.at_level("WARNING"):
        handle = offload_layers(model.layers, 2, mode="async", pin_memory=False, accelerator=_PinnableCpu("cpu"))
    assert handle.copies.non_blocking is False and "pin_memory=False copies from pageable memory" in caplog.text
    pinned_cpu = offload_layers(tiny_model().layers, 2, mode="async", accelerator=Accelerator("cpu"))
    assert pinned_cpu.copies.non_blocking is False  # no pinned memory without a device


def test_the_first_offloaded_block_in_backward_is_prefetched():
    """Its reload starts while the block above it runs backward, not when backward first needs it."""
    model = tiny_model()
    handle = offload_layers(model.layers, 3, mode="async", accelerator=Accelerator("cpu"))
    started_ahead = {}
    ensure = handle._ensure_reloaded

    def spy(group):
        started_ahead.setdefault(group.index, group.h2d_done is not None)
        ensure(group)

    handle._ensure_reloaded = spy
    step(model)
    assert started_ahead == {2: True, 1: True, 0: True}


def test_async_offload_never_blocks_the_host_inside_hooks(monkeypatch):
    """On a device every wait in forward and backward must be a stream wait: count the host waits."""
    from fake_device import fake_accelerator

    acc, host_waits = fake_accelerator(monkeypatch)
    model = tiny_model()
    handle = offload_layers(model.layers, 3, mode="async", accelerator=acc)
    handle._is_host = lambda t: False  # the cpu tensors stand for device memory here
    for _ in range(2):
        step(model)
    assert handle.metrics()["act_offload_offloaded_bytes"] > 0
    assert host_waits == {}
    handle._copy_out = lambda slot, copy_out=handle._copy_out: copy_out(slot) or handle.copies.d2h.synchronize()
    step(model)  # control: a host wait in a hook is counted
    assert host_waits["stream.synchronize"] > 0


@pytest.fixture
def group_of_one():
    """A gloo process group of this one process, for DTensors on a one-rank mesh."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dtensor_activations_go_as_local_shards_and_dtensor_params_stay(group_of_one):
    """Tensor parallel: a column-parallel linear saves its input and its weight's local shard, a
    sequence-parallel norm saves DTensors. The DTensor activations go to the host as their local shards and
    come back in their layout (bitwise gradients); a parameter's local shard never goes (FSDP2 frees its
    storage after forward while a copy would still read it: a segfault on a copy thread under load)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

    from internlm_offload.model.norm import RMSNorm

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    reference = nn.Sequential(RMSNorm(64, 1e-6), nn.Linear(64, 64, bias=False))
    x = torch.randn(2, 8, 64)
    reference(x).sum().backward()
    block = nn.Sequential(RMSNorm(64, 1e-6), nn.Linear(64, 64, bias=False))
    block.load_state_dict(reference.state_dict())
    parallelize_module(block, mesh, {"0": SequenceParallel(), "1": ColwiseParallel()})
    layers = nn.ModuleList([block, nn.Identity()])
    handle = offload_layers(layers, 1, mode="sync", min_offload_bytes=0)
    out = layers[1](layers[0](x))
    out.sum().backward()
    assert handle.metrics()["act_offload_host_bytes"] >= 2 * x.numel() * 4  # DTensor activations, as shards
    for ours, theirs in zip(block.parameters(), reference.parameters()):
        grad = ours.grad.full_tensor() if isinstance(ours.grad, DTensor) else ours.grad
        assert torch.equal(grad, theirs.grad)
    handle.close()
    # Only the weight (16 KiB) is above this threshold, the activations (4 KiB each) are below: nothing goes.
    handle = offload_layers(layers, 1, mode="sync", min_offload_bytes=8 << 10)
    layers[1](layers[0](x)).sum().backward()
    assert handle.metrics()["act_offload_offloaded_bytes"] == 0
    handle.close()


def tiny_moe_model(moe_type: str, dtype: torch.dtype) -> InternLM2:
    torch.manual_seed(0)
    model = InternLM2(
        num_layers=L, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=259,
        num_experts=4, top_k=2, moe_type=moe_type, num_shared_experts=1, mlp_ratio=1.0, multiple_of=32,
        moe_layer_kwargs={"capacity_factor": 0.5} if moe_type == "GShard" else None,
    )  # fmt: skip
    return model.to(dtype)


def moe_step(model: InternLM2, micro_num: int = 2):
    """`step` for a model that also returns its load-balancing loss; adds the per-expert token counts."""
    losses, logits = [], None
    for tokens in batches(micro_num):
        out = model(tokens[:, :-1])
        logits, aux = out.logits, out.aux_losses["moe_aux"]
        loss = (F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) + aux) / micro_num
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return torch.stack(losses), logits.detach(), grads, model.tokens_per_expert()


@pytest.mark.parametrize(
    "moe_type, dtype",
    [("GShard", torch.float32), ("Dropless", torch.bfloat16), ("GShard", torch.float16)],
    ids=["gshard-fp32", "dropless-bf16-grouped-gemm", "gshard-fp16-expert-loop"],
)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_moe_blocks_offload_their_routing_and_come_back_bitwise(moe_type, dtype, mode):
    """MoE blocks (GShard at capacity factor 0.5: choices dropped) offloaded down to the smallest saved tensor:
    the router's logits, the int64 top-k indices and permutation order, the counts and the experts' rows go to the
    host and come back byte for byte, beside full and selective checkpointing (the fp16 experts run as a loop over
    slices whose sizes the routing decides): losses, logits, gradients and counts equal no offload's."""
    expected = moe_step(tiny_moe_model(moe_type, dtype))
    model = tiny_moe_model(moe_type, dtype)
    apply_activation_checkpointing(model.layers, [2], selective=True)
    apply_activation_checkpointing(model.layers, [3], selective=False)
    int64_saved = []
    handle = offload_layers(model.layers, 2, mode=mode, min_offload_bytes=0)
    original = handle._offload

    def spy(t, index):
        int64_saved.append(t.dtype == torch.int64)
        return original(t, index)

    handle._offload = spy
    got = moe_step(model)
    handle.close()
    assert any(int64_saved) and handle.metrics()["act_offload_offloaded_bytes"] > 0
    assert_bitwise(got[:3], expected[:3])
    assert torch.equal(got[3], expected[3])
