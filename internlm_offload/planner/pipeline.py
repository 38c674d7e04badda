"""A pipeline rank's step in one process for the planner, in the order torch's schedule runs it, and the
schedule's bubble.

The order is torch's own: each schedule's `pipeline_order` (rank -> actions: F forward, B full backward, I and W
the zero-bubble schedules' input and weight passes), read off the schedule object the builder made; no formula of
in-flight micro-batches is written here. Two readings of it:
- each stage runs its micro-batches in order, so the k-th forward (and the k-th B, I or W) of a stage is micro-batch
  k: torch 2.13's `Schedule1F1B.pipeline_order` numbers its last rank's forwards from 1 (its step runs its own loop,
  whose warm-up, min(m, P - s) forwards, the list matches), and the renumbering reads every schedule alike;
- a zero-bubble micro-batch is in flight from its F to its W: the local run calls torch's own input and weight
  passes (`stage_backward_input`, `stage_backward_weight`: what the I keeps for the W, the intermediates' gradients
  included, is held between them), and on the first stage the whole backward at W, as torch's stage does.

`LocalSchedule` runs the rank's actions on its stages' own modules without sends: a non-first stage's input is the
receive buffer torch allocates for each micro-batch (one per micro-batch, kept between steps, its gradient kept to
the next step's start, as `PipelineStage` does), a non-last stage's output gradient the receive buffer torch keeps
likewise; the last stage's loss is the runner's. What the stages' hooks (activation offload, the masters'
accumulation) see is the order of the rank's forwards and backwards, as under torch's schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from internlm_offload.config import RunConfig
from internlm_offload.config.pipeline import virtual_chunks
from internlm_offload.data.loader import MicroBatch
from internlm_offload.engine.pipeline import PipelineRunner, schedule_class
from internlm_offload.config.pipeline_partition import local_stages
from internlm_offload.engine.tensor_parallel import loss_context
from internlm_offload.planner.cost import Hardware, StepTime, StepWork, step_time

# torch's _ComputationType is a str enum: its values name the passes
FORWARD, BACKWARD, INPUT, WEIGHT = "F", "B", "I", "W"
# a backward pass costs about twice its forward (two matmuls per forward one); zero-bubble splits it evenly
BACKWARD_PER_FORWARD = 2.0


@dataclass
class StageMemory:
    """One pipeline rank's figures: its stages' steady-step peaks and the micro-batches it holds in flight."""

    pp_rank: int
    device_peak_bytes: int
    host_peak_bytes: int
    first_step_device_peak_bytes: int
    in_flight: int
    activation_bytes: int  # what one micro-batch's forward through the rank's first stage leaves alive
    micro_batch_work: StepWork  # the rank's mean per micro-batch (its stages' passes)


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str  # FORWARD, BACKWARD, INPUT or WEIGHT
    micro_batch: int


def schedule_order(mode: str, num_chunks: int, size: int, micro_num: int) -> dict[int, list]:
    """torch's `pipeline_order` of the schedule the engine picks (`schedule_class`), built over stand-ins for the
    stages (the order is every rank's, computed from the stage count, the rank count and `micro_num` alone)."""
    cls = schedule_class(mode, num_chunks)
    num_stages = size * num_chunks
    stages = [
        SimpleNamespace(
            stage_index=s,
            num_stages=num_stages,
            group_size=size,
            group_rank=0,
            submod=nn.Module(),
            is_first=s == 0,
            is_last=s == num_stages - 1,
            has_backward=True,
            stage_index_to_group_rank={},
        )
        for s in local_stages(0, size, num_chunks, v_shape=mode == "ZBV")
    ]
    single = cls is Schedule1F1B
    return cls(stages[0] if single else stages, micro_num, scale_grads=False).pipeline_order  # type: ignore[arg-type]


def rank_actions(order: dict[int, list], rank: int) -> list[Action]:
    """`rank`'s compute actions in torch's order (`pipeline_order[rank]`; idle steps, sends and reductions
    dropped), micro-batches numbered in order per stage and pass (the module docstring)."""
    seen: dict[tuple[int, str], int] = {}
    actions = []
    for action in order[rank]:
        if action is None or action.computation_type not in (FORWARD, BACKWARD, INPUT, WEIGHT):
            continue
        kind = str(action.computation_type.value)
        key = (action.stage_index, kind)
        seen[key] = seen.get(key, -1) + 1
        actions.append(Action(action.stage_index, kind, seen[key]))
    return actions


def releases(action: Action) -> bool:
    """Whether `action` ends its micro-batch's stay in flight: a B, or a W (an I keeps the graph for W)."""
    return action.kind == BACKWARD or action.kind == WEIGHT


def rank_in_flight(order: dict[int, list], rank: int) -> int:
    """The most micro-batches `rank` holds in flight over all its stages together (its activation peak's count,
    in stage-micro-batches: an interleaved rank's chunk holds 1/num_chunks of its blocks)."""
    live = peak = 0
    for action in rank_actions(order, rank):
        live += 1 if action.kind == FORWARD else -1 if releases(action) else 0
        peak = max(peak, live)
    return peak


def makespan(order: dict[int, list], forward_s: dict[int, float]) -> float:
    """Seconds from the first forward to the last backward when every rank runs its actions in torch's order, each
    as soon as its input is there (a forward after the previous stage's forward of that micro-batch, a backward
    after the next stage's, free sends): `forward_s` per stage, a backward `BACKWARD_PER_FORWARD` times it (an I
    and a W half of that each)."""
    num_stages = len(forward_s)
    pending = {rank: rank_actions(order, rank) for rank in order}
    done: dict[tuple[int, str, int], float] = {}
    clock = dict.fromkeys(order, 0.0)
    while any(pending.values()):
        progressed = False
        for rank, actions in pending.items():
            while actions:
                ready = _ready_at(actions[0], done, num_stages)
                if ready is None:
                    break
                action = actions.pop(0)
                clock[rank] = max(clock[rank], ready) + _seconds(action, forward_s)
                done[(action.stage, action.kind, action.micro_batch)] = clock[rank]
                progressed = True
        if not progressed:
            raise ValueError("the schedule's actions wait on each other")
    return max(clock.values())


def _ready_at(action: Action, done: dict[tuple[int, str, int], float], num_stages: int) -> float | None:
    """When `action`'s input arrives (None: not yet produced)."""
    if action.kind == FORWARD:
        needed = [] if action.stage == 0 else [(action.stage - 1, FORWARD, action.micro_batch)]
    elif action.kind == WEIGHT:
        needed = [(action.stage, INPUT, action.micro_batch)]
    elif action.stage == num_stages - 1:
        needed = [(action.stage, FORWARD, action.micro_batch)]
    else:  # the next stage's input gradient: its B or I
        later = [(action.stage + 1, kind, action.micro_batch) for kind in (BACKWARD, INPUT)]
        needed = [next((key for key in later if key in done), later[0])]
    if any(key not in done for key in needed):
        return None
    return max((done[key] for key in needed), default=0.0)


def _seconds(action: Action, forward_s: dict[int, float]) -> float:
    share = {FORWARD: 1.0, BACKWARD: BACKWARD_PER_FORWARD, INPUT: BACKWARD_PER_FORWARD / 2}
    return forward_s[action.stage] * share.get(action.kind, BACKWARD_PER_FORWARD / 2)


def bubble_fraction(order: dict[int, list], micro_num: int) -> float:
    """The share of the step's forward-backward time a rank idles, stages of equal time: 1 - busy / makespan.
    1F1B gives (P - 1) / (m + P - 1), interleaved 1F1B over v chunks (P - 1) / (v m + P - 1); zero bubble less."""
    stages = sorted({a.stage for rank in order for a in rank_actions(order, rank)})
    per_rank = len(stages) // len(order)
    forward_s = dict.fromkeys(stages, 1.0 / per_rank)  # a rank's stages together: one unit per forward
    busy = micro_num * (1.0 + BACKWARD_PER_FORWARD)
    return 1.0 - busy / makespan(order, forward_s)


def pipeline_step_time(cfg: RunConfig, stages: Sequence[StageMemory], optimizer: StepWork, hw: Hardware) -> StepTime:
    """The step of a pipeline: the makespan of torch's order of the configured schedule (`makespan`) with each
    rank's stages sharing its traced per-micro-batch time (`step_time`'s micro-batch over `stages[r]`), plus the
    traced rank's optimizer step (the ranks step at once). Its bubble is 1 - m x the slowest rank's micro-batch
    time / the makespan: (P - 1) / (m + P - 1) for 1F1B over equal stages, (P - 1) / (v m + P - 1) interleaved over
    v chunks, a third of 1F1B's bubble time for ZBH1 (`bubble_fraction`; tests/unit/test_planner_pipeline.py)."""
    pipe = cfg.parallel.pipeline
    chunks = virtual_chunks(pipe.mode, cfg.model.num_chunks)
    order = schedule_order(pipe.mode, chunks, pipe.size, cfg.data.micro_num)
    per_rank = [step_time(stage.micro_batch_work, StepWork(), 1, hw).micro_batch_s for stage in stages]
    forward_s: dict[int, float] = {}
    for rank, seconds in enumerate(per_rank):
        local = local_stages(rank, pipe.size, chunks, v_shape=pipe.mode == "ZBV")
        forward_s.update(dict.fromkeys(local, seconds / (len(local) * (1 + BACKWARD_PER_FORWARD))))
    span = makespan(order, forward_s)
    optimizer_s = step_time(StepWork(), optimizer, 0, hw).optimizer_s
    bubble = 1 - cfg.data.micro_num * max(per_rank) / span if span else 0.0
    return StepTime(span + optimizer_s, max(per_rank), optimizer_s, hw, bubble)


def planned_step_time(
    cfg: RunConfig, stages: Sequence[StageMemory], micro_batch: StepWork, optimizer: StepWork, hw: Hardware
) -> StepTime:
    """`step_time` of a traced step (its `stages`, `micro_batch_work` and `optimizer_work`): the pipeline's
    (`pipeline_step_time`) where it has stages."""
    if stages:
        return pipeline_step_time(cfg, stages, optimizer, hw)
    return step_time(micro_batch, optimizer, cfg.data.micro_num, hw)


class LocalSchedule:
    """The runner's `forward_backward` for the planner: this rank's actions on its stages without sends (the
    module docstring); the runner's reductions over stages as they are (the fake process group)."""

    def __init__(self, runner: PipelineRunner, pp_rank: int, activation: tuple[int, torch.dtype, int]) -> None:
        """`activation`: the hidden size and dtype of what stages send each other, and the parts of the sequence
        it is cut into over the tensor ranks (msp, fsp, isp: T; else 1)."""
        self.runner = runner
        self.stages = {stage.stage_index: stage for stage in runner.stages}
        self.actions = rank_actions(runner.schedule.pipeline_order, pp_rank)
        self._hidden, self._dtype, self._sequence_parts = activation
        # torch's receive buffers, per stage and micro-batch
        self._inputs: dict[int, list[tuple[torch.Tensor, ...]]] = {}
        self._output_grads: dict[int, list[tuple[torch.Tensor, ...]]] = {}

    def reduce_losses(self, values: torch.Tensor) -> None:
        self.runner.reduce_losses(values)

    def global_norm(self, stage_norm: torch.Tensor) -> torch.Tensor:
        return self.runner.global_norm(stage_norm)

    def forward_backward(
        self,
        micro_batches: list[MicroBatch],
        token_weight: float,
        aux_weight: float = 1.0,
        after_backward: Callable[[], None] | None = None,
        *,
        mtp_weights: tuple[float, ...] = (),
        loss_scale: float = 1.0,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The rank's actions over `micro_batches`, as the runner's `forward_backward` (the engine's docstring); the
        stages run as in torch's shape inference, their routing not recorded (no auxiliary loss: a few scalars)."""
        device = self.runner.ctx.device
        micro_num = len(micro_batches)
        ids, labels, *positions = (
            torch.cat([mb[i] for mb in micro_batches]).to(device) for i in range(len(micro_batches[0]))
        )
        targets = self.runner.targets(labels, positions[0] if positions else None).chunk(micro_num)
        ids, positions = ids.chunk(micro_num), [p.chunk(micro_num) for p in positions]
        self.runner.start_step(after_backward, aux_weight, loss_scale)
        with loss_context(self.runner.loss_parallel):  # vocab-sharded logits: the loss and its backward inside
            self._run_actions(ids, targets, positions, (token_weight, tuple(mtp_weights)), after_backward)
        return self.runner.step_loss_sum(micro_num), self.runner.step_aux_sums()

    def _run_actions(
        self,
        ids: tuple[torch.Tensor, ...],
        targets: tuple[torch.Tensor, ...],
        positions: list[tuple[torch.Tensor, ...]],
        weights: tuple[float, tuple[float, ...]],
        after_backward: Callable[[], None] | None,
    ) -> None:
        """This rank's actions in torch's order on the micro-batches' chunks. A stage takes and returns a tuple
        where multi-token prediction's inputs travel beside the hidden state (engine/pipeline_split.py)."""
        for buffers in self._inputs.values():  # PipelineStage.clear_runtime_states
            for buffer in (b for micro_batch in buffers for b in micro_batch):
                buffer.grad = None
        micro_num = len(ids)
        in_flight: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        weight_passes: dict[tuple[int, int], list[dict[str, Any]]] = {}  # what an I keeps for its W
        for action in self.actions:
            stage, mb, key = self.stages[action.stage], action.micro_batch, (action.stage, action.micro_batch)
            if action.kind == FORWARD:
                kwargs = {"position_ids": positions[0][mb]} if positions else {}
                x = (ids[mb],) if stage.is_first else self._input(action.stage, ids[mb].shape, mb, micro_num)
                out = stage.submod(*x, **kwargs)
                if stage.is_last:
                    out = self.runner.loss(out, targets[mb], *weights)
                in_flight[key] = out if isinstance(out, tuple) else (out,)
                continue
            if action.kind == INPUT and not stage.is_first:  # torch's input pass: the inputs' gradients now
                outs = in_flight.pop(key)
                grads = None if stage.is_last else list(self._output_grad(action.stage, outs, micro_num)[mb])
                inputs = list(self._inputs[action.stage][mb])
                weight_passes[key] = stage_backward_input(list(outs), grads, inputs, stage.submod.parameters())[1]
            elif action.kind == WEIGHT and key in weight_passes:  # its weight pass, from what the I kept
                stage_backward_weight(stage.submod.parameters(), weight_passes.pop(key))
            elif action.kind != INPUT:  # B, or the first stage's W: the whole backward (torch's, both)
                outs = in_flight.pop(key)
                grads = None if stage.is_last else self._output_grad(action.stage, outs, micro_num)[mb]
                torch.autograd.backward(outs, grads)
            if after_backward is not None:
                after_backward()

    def _input(self, stage: int, ids_shape: torch.Size, micro_batch: int, micro_num: int) -> tuple[torch.Tensor, ...]:
        """The receive buffers of `stage`'s micro-batch: the hidden state, then each multi-token-prediction depth's
        input embedding (the same shape)."""
        if stage not in self._inputs:
            batch, seq_len = ids_shape
            shape = (batch, seq_len // self._sequence_parts, self._hidden)
            device = self.runner.ctx.device
            received = 1 + self.runner.mtp_depth
            self._inputs[stage] = [
                tuple(torch.empty(shape, dtype=self._dtype, device=device).requires_grad_() for _ in range(received))
                for _ in range(micro_num)
            ]
        return self._inputs[stage][micro_batch]

    def _output_grad(
        self, stage: int, outputs: tuple[torch.Tensor, ...], micro_num: int
    ) -> list[tuple[torch.Tensor, ...]]:
        if stage not in self._output_grads:
            self._output_grads[stage] = [tuple(torch.empty_like(o) for o in outputs) for _ in range(micro_num)]
        return self._output_grads[stage]
