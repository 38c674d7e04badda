"""Activation offload under a pipeline, in one process: a rank's stage modules run the forwards and backwards of
several micro-batches in a schedule's order, as torch's PipelineStage calls them. Each micro-batch's activations
come back when the schedule is about to run its backward, and the gradients are bitwise those of no offload.
tests/e2e/test_pipeline_e2e.py runs the same under torch's schedules on two processes."""

from collections.abc import Callable

import pytest
import torch

from internlm_offload.device import Accelerator
from internlm_offload.engine.pipeline_split import PipelineChunk, split_model, stage_blocks
from internlm_offload.model.families.internlm2.model import InternLM2
from internlm_offload.offload.activation import ActivationOffloader
from internlm_offload.offload.selective_offload import SelectiveOffloader

Step = tuple[str, int, int]  # ("F" or "B", stage, micro-batch)

# The first stage of 1F1B at P = 2 over 4 micro-batches: two in flight after the warm-up.
ONE_F_ONE_B: list[Step] = [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("F", 0, 3)]
ONE_F_ONE_B += [("B", 0, 2), ("B", 0, 3)]
# Rank 0 under an interleaved order at P = 2 over 2 chunks (stages 0 and 2) and 4 micro-batches: chunk 0 runs
# ahead, backwards interleave with forwards; rank 1's stages left out (stage 2 takes stage 0's output).
INTERLEAVED: list[Step] = [("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1), ("F", 0, 2), ("B", 2, 0)]
INTERLEAVED += [("F", 0, 3), ("B", 2, 1), ("F", 2, 2), ("B", 0, 0), ("F", 2, 3), ("B", 0, 1), ("B", 2, 2)]
INTERLEAVED += [("B", 2, 3), ("B", 0, 2), ("B", 0, 3)]


def decoder() -> InternLM2:
    torch.manual_seed(0)
    return InternLM2(num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=259)


def run(
    chunks: dict[int, PipelineChunk],
    order: list[Step],
    log: list[str] | None = None,
    after_forward: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Run `order`; a stage's input is the previous local stage's output (detached, as a pipeline receives it),
    its backward takes a fixed output gradient. Returns the parameters' gradients."""
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 259, (2, 32), generator=g) for _ in range(4)]
    grads = [torch.randn(2, 32, 64, generator=g) for _ in range(4)]
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    first = min(chunks)
    for kind, stage, micro in order:
        if log is not None:
            log.append(f"{kind}{stage}.{micro}")
        if kind == "F":
            previous = [s for s in chunks if s < stage]
            x = tokens[micro] if stage == first else outputs[(previous[-1], micro)].detach().requires_grad_()
            outputs[(stage, micro)] = chunks[stage](x)
            if after_forward is not None:
                after_forward(stage, micro)
        else:
            outputs.pop((stage, micro)).backward(grads[micro])
    return {name: p.grad.clone() for chunk in chunks.values() for name, p in chunk.named_parameters()}


def offloaded(chunks: dict[int, PipelineChunk], num_layers: int) -> ActivationOffloader:
    segments = [len(chunk.layers) for chunk in chunks.values()]
    return ActivationOffloader(stage_blocks(chunks), num_layers, mode="async", segments=segments)


def reload_logged(
    chunks: dict[int, PipelineChunk], num_layers: int
) -> tuple[ActivationOffloader, list[str], dict[int, str]]:
    """`offloaded(chunks, num_layers)` with its reloads logged: (offloader, the log, group id -> its name)."""
    offloader, log, names = offloaded(chunks, num_layers), [], {}
    log_reloads(offloader, log, names)
    return offloader, log, names


def log_reloads(offloader: ActivationOffloader, log: list[str], names: dict[int, str]) -> None:
    """Append `R<stage>.<micro-batch>` to `log` when a group's reload starts (not when it was started already)."""
    start = offloader._start_reload

    def logged(group) -> None:
        if group.h2d_done is None and any(s.reloaded is None for s in group.slots.values()):
            log.append(names.get(id(group), "R?"))
        start(group)

    offloader._start_reload = logged


def name_groups(offloader: ActivationOffloader, names: dict[int, str], stage: int, micro: int, keep: list) -> None:
    """Name the top group of the forward that just ended on the stage of segment `stage`."""
    flight = offloader._waiting[stage][-1]
    group = flight.top[0]()
    keep.append(group)
    names[id(group)] = f"R{stage}.{micro}"


@pytest.mark.parametrize(
    ("size", "chunks", "order", "num_layers"),
    [(2, 1, ONE_F_ONE_B, 1), (2, 2, INTERLEAVED, 1)],
    ids=["1f1b", "interleaved"],
)
def test_gradients_bitwise_under_the_schedule_order(size, chunks, order, num_layers):
    """The rank's blocks offloaded per stage: every gradient equals the same order without offload, bit for bit;
    the host copies are returned once the graphs are gone."""
    expected = run(split_model(decoder(), size, chunks, 0, False), order)
    stages = split_model(decoder(), size, chunks, 0, False)
    offloader = offloaded(stages, num_layers)
    moved: list[float] = []  # each stage forward's offloaded bytes (the metrics are the last forward's)
    got = run(stages, order, after_forward=lambda *_: moved.append(offloader.metrics()["act_offload_offloaded_bytes"]))
    assert sum(moved) > 0
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name
    assert not any(offloader._waiting.values())  # every forward's backward ran
    offloader.close()


def test_the_next_backward_comes_back_after_each_forward_in_the_schedule_order():
    """1F1B's first stage (blocks 0-1, block 0 offloaded): after each forward in the steady state the oldest
    micro-batch in flight starts reloading (the schedule's next backward on this stage), never the forward that
    just ended; the last backward, with no forward before it, reloads when its own backward reaches block 1.
    Red when the newest micro-batch in flight is reloaded instead of the oldest."""
    stages = split_model(decoder(), 2, 1, 0, False)
    offloader, log, names = reload_logged(stages, 1)
    keep: list = []
    run(stages, ONE_F_ONE_B, log, lambda stage, micro: name_groups(offloader, names, stage, micro, keep))
    assert log == ["F0.0", "F0.1", "R0.0", "B0.0", "F0.2", "R0.1", "B0.1", "F0.3", "R0.2", "B0.2", "B0.3", "R0.3"]
    offloader.close()


def test_a_stage_whose_blocks_are_all_offloaded_releases_them_at_its_end():
    """Interleaved: stage 0 is one offloaded block (the last block of its stage). Its device copies are released
    when the stage's forward ends, before another stage's forward runs, and it comes back ahead of its backward
    (after the stage's next forward), not on demand. Red when a forward ends only at the rank's last block."""
    stages = split_model(decoder(), 2, 2, 0, False)
    offloader, log, names = reload_logged(stages, 1)
    keep: list = []
    outputs = []
    for _, stage, micro in INTERLEAVED[:2]:
        outputs.append(run_forward(stages, stage, micro))
        assert offloader._forward is None
        group = offloader._waiting[0][-1].top[0]()
        assert group is not None and all(slot.source is None for slot in group.slots.values())
        keep.append(group)
        names[id(group)] = f"R0.{micro}"
    assert log == ["R0.0"]  # after micro-batch 1's forward: micro-batch 0, the stage's next backward
    offloader.close()


def run_forward(stages: dict[int, PipelineChunk], stage: int, micro: int) -> torch.Tensor:
    tokens = torch.randint(0, 259, (2, 32), generator=torch.Generator().manual_seed(micro))
    return stages[stage](tokens)


def test_selective_offload_keeps_each_stage_forward_apart():
    """Selective checkpointing of both blocks of 1F1B's first stage with the kept outputs on the host: each stage
    forward ends with its outputs' copies done and released, and the next micro-batch's first block does not chain
    its prefetch to the previous micro-batch's last block; gradients bitwise those without it. Red without the
    stage boundaries (the last block's outputs stay on the device until another micro-batch's forward)."""
    expected = run(split_model(decoder(), 2, 1, 0, False), ONE_F_ONE_B)
    stages = split_model(decoder(), 2, 1, 0, False)
    offloader = SelectiveOffloader(stage_blocks(stages), [0, 1], accelerator=Accelerator("cpu"), segments=[2])
    ends: list[tuple] = []
    got = run(stages, ONE_F_ONE_B, after_forward=lambda *_: ends.append((offloader._unreleased, offloader._last)))
    assert ends == [(None, None)] * 4
    assert offloader.offloaded_bytes > 0
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name
    offloader.close()
