"""Pipeline parallel on torch.distributed.pipelining: this rank's stages, their schedule, and the step's
cross-stage reductions the trainer calls (`PipelineRunner`).

The schedule is torch's (1F1B, interleaved 1F1B, ZBH1 as torch's interleaved zero bubble, ZBV) and so are all
sends and receives. `data.micro_num` micro-batches of a step are the schedule's micro-batches. The loss each
micro-batch backpropagates is the trainer's: its token-loss sum times the step's token weight (1 / labelled
tokens of the rank's micro-batches, times the fp16 loss scale), so the schedule must not scale the gradients
again (`scale_grads=False`): the gradients are the sum over micro-batches, as without a pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.nn.parallel import DistributedDataParallel

from internlm_offload.data.loader import MicroBatch
from internlm_offload.engine.loss import mtp_labels, token_loss_sum
from internlm_offload.engine.pipeline_split import PipelineChunk
from internlm_offload.engine.runtime import RunContext, stage_data_mesh
from internlm_offload.engine.sequence_parallel import SequenceShard
from internlm_offload.engine.tensor_parallel import local_loss, loss_context
from internlm_offload.model.output import MTP


def schedule_class(mode: str, num_chunks: int) -> type[_PipelineSchedule]:
    """InternEvo's scheduler choice on torch's classes: ZBV, ZBH1, interleaved 1F1B over several chunks, 1F1B."""
    if mode == "ZBV":
        return ScheduleZBVZeroBubble
    if mode == "ZBH1":
        return ScheduleInterleavedZeroBubble
    return ScheduleInterleaved1F1B if num_chunks > 1 else Schedule1F1B


class _Stage(PipelineStage):
    """torch's stage, calling `after_backward` once each backward of a micro-batch has run (the whole backward,
    or the zero-bubble schedules' input pass and weight pass each): the masters' per-micro-batch gradient
    accumulation (fp32 masters add the low-precision gradients, gradient offload sends its last bucket and takes
    the weight pass's gradients, which torch assigns to `.grad` past the post-accumulate-grad hooks). Its chunk
    records its routing in the forwards of micro-batches alone, not in torch's shape inference
    (engine/pipeline_split.py)."""

    def __init__(self, *args: Any, after_backward: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._after_backward = after_backward
        self.chunk = stage_chunk(self.submod)

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        self.chunk.record_routing = True
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.chunk.record_routing = False

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        super().backward_one_chunk(*args, **kwargs)
        self._after_backward()

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        super().backward_weight_one_chunk(*args, **kwargs)
        self._after_backward()


def stage_chunk(module: nn.Module) -> PipelineChunk:
    """The `PipelineChunk` a stage's module is (FSDP2) or wraps (DDP)."""
    return next(m for m in module.modules() if isinstance(m, PipelineChunk))


class PipelineRunner:
    """Runs one step's micro-batches through this rank's stages and joins what the trainer reduces over stages."""

    def __init__(
        self,
        ctx: RunContext,
        modules: dict[int, nn.Module],
        num_stages: int,
        schedule_cls: type[_PipelineSchedule],
        micro_num: int,
        *,
        label_smoothing: float = 0.0,
        loss_parallel: bool = False,
        sequence_shard: SequenceShard | None = None,
    ) -> None:
        """`modules`: this rank's stage modules by stage index (wrapped in DDP where data parallel).
        `loss_parallel`: vocab-sharded logits (mtp/msp/fsp with `parallel_output`), the step runs under
        `loss_parallel`; `sequence_shard` (isp): the last stage's loss takes this rank's chunk of the labels."""
        self.ctx = ctx
        self.holds_first = 0 in modules
        self.holds_last = num_stages - 1 in modules
        # Under tensor parallel the mesh is ("pp", "dp", "tp"): the "pp" group joins this (dp, tp) coordinate's
        # ranks over the stages, so each tensor rank's sends and receives pair it with the same tensor rank.
        self._pp_group = ctx.pipeline_mesh["pp"].get_group()
        self._dp_group = ctx.pipeline_mesh["dp"].get_group()
        tensor = "tp" in (ctx.pipeline_mesh.mesh_dim_names or ())
        self._tp_group = ctx.pipeline_mesh["tp"].get_group() if tensor else None
        # isp's tensor ranks hold their chunks' losses (averaged); mtp/msp/fsp's the same loss: MAX keeps its bits
        # and, as for every tensor mode, agrees the stop flag over the stage's tensor ranks
        self._tp_op = dist.ReduceOp.AVG if sequence_shard is not None else dist.ReduceOp.MAX
        self._label_smoothing = label_smoothing
        self.loss_parallel = loss_parallel
        self._sequence_shard = sequence_shard
        self._sums: list[torch.Tensor] = []  # this step's per-micro-batch loss sums, in micro-batch order
        self._mtp_sums: list[torch.Tensor] = []  # and their multi-token-prediction losses (weighted)
        self._loss_scale = 1.0  # this step's (fp16), on the multi-token-prediction loss in the objective
        self.chunks = [stage_chunk(m) for m in modules.values()]  # this rank's, in stage order
        # the auxiliary losses every stage logs (0 where it holds no sparse block), in the trainer's order, then
        # multi-token prediction's (0 off the last stage)
        self.mtp_depth = self.chunks[0].mtp_depth
        self.aux_names = list(self.chunks[0].aux_losses.coefficients) + ([MTP] if self.mtp_depth else [])
        # torch infers the shapes the stages exchange on the first step (one micro-batch's forward and its input
        # gradients, no parameter gradient)
        self._after_backward: Callable[[], None] | None = None  # this step's, from `forward_backward`
        stages = [
            _Stage(m, index, num_stages, ctx.device, group=self._pp_group, after_backward=self._micro_batch_done)
            for index, m in modules.items()
        ]
        self.stages: list[PipelineStage] = list(stages)  # this rank's, in stage order (the planner runs them too)
        single = schedule_cls is Schedule1F1B
        # scale_grads=False: the loss is already the trainer's share of the step (see the module's docstring)
        self.schedule = schedule_cls(stages[0] if single else stages, micro_num, loss_fn=self.loss, scale_grads=False)
        self._micro_num = micro_num

    def loss(
        self,
        output: torch.Tensor | tuple[torch.Tensor, ...],
        target: torch.Tensor,
        weight: float,
        mtp_weights: tuple[float, ...] = (),
    ) -> torch.Tensor:
        """One micro-batch's loss on the last stage: its token-loss sum (kept for `step_loss_sum`) times `weight`.
        With multi-token prediction `output` is the logits, then each depth's, and `target` (B, 1 + D, T) the labels,
        then each depth's (`mtp_targets`), depth k's loss sum weighed by `mtp_weights[k - 1]` (kept apart: the
        step's `mtp` auxiliary loss)."""
        logits, *depth_logits = output if isinstance(output, tuple) else (output,)
        targets = target.unbind(1) if depth_logits else (target,)
        if self._sequence_shard is not None:  # shifted before the split, as the tokens were
            targets = tuple(self._sequence_shard.local(t) for t in targets)
        loss_sum = token_loss_sum(logits, targets[0], label_smoothing=self._label_smoothing)
        self._sums.append(local_loss(loss_sum).detach())
        objective = loss_sum * weight
        if depth_logits:
            mtp = sum(
                token_loss_sum(d, t, label_smoothing=self._label_smoothing) * w
                for d, t, w in zip(depth_logits, targets[1:], mtp_weights, strict=True)
            )
            self._mtp_sums.append(local_loss(mtp).detach())
            objective = objective + mtp * self._loss_scale
        return objective

    def _micro_batch_done(self) -> None:
        if self._after_backward is not None:
            self._after_backward()

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
        """Forward and backward of every micro-batch through the pipeline: the sum of their token-loss sums on
        the rank holding the last stage, 0 elsewhere, and each auxiliary loss (coefficient-weighted) summed over
        the micro-batches and this rank's stages (`reduce_losses` brings both to every rank, the auxiliary losses
        summed over the stages). Each stage backpropagates its own auxiliary losses times `aux_weight`
        (engine/stage_aux_loss.py). `after_backward` runs after each backward pass of a micro-batch on this rank's
        stages (the masters' `accumulate_grads`). Multi-token prediction's depth k is weighed by `mtp_weights[k - 1]`
        (times `loss_scale` in the objective), its step's sum logged as the auxiliary loss `mtp`."""
        device = self.ctx.device
        input_ids, labels, *positions = (
            torch.cat([mb[i] for mb in micro_batches]).to(device) for i in range(len(micro_batches[0]))
        )
        kwargs = {"position_ids": positions[0]} if positions else {}  # every stage applies RoPE
        target = self.targets(labels, positions[0] if positions else None)
        self.start_step(after_backward, aux_weight, loss_scale)
        with loss_context(self.loss_parallel):  # the loss and its backward run inside the step
            self.schedule.step(
                *((input_ids,) if self.holds_first else ()),
                target=target if self.holds_last else None,
                losses=[] if self.holds_last else None,
                return_outputs=False,  # the last stage's logits would stay alive for every micro-batch
                loss_kwargs={"weight": token_weight, "mtp_weights": tuple(mtp_weights)},
                **kwargs,
            )
        return self.step_loss_sum(len(micro_batches)), self.step_aux_sums()

    def targets(self, labels: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """What the last stage's `loss` scores: the labels, or with multi-token prediction (B, 1 + D, T) the labels
        and each depth's, rolled on the whole sequence inside its documents as the first stage rolls the ids."""
        if not self.mtp_depth:
            return labels
        return torch.stack([labels, *mtp_labels(labels, position_ids, self.mtp_depth)], 1)

    def start_step(
        self, after_backward: Callable[[], None] | None, aux_weight: float = 1.0, loss_scale: float = 1.0
    ) -> None:
        """Forget the last step's loss sums; `after_backward` runs after each backward pass of this step, the
        stages weigh their auxiliary losses by `aux_weight`, the multi-token-prediction loss is scaled by
        `loss_scale` (fp16's) in the objective."""
        self._sums, self._mtp_sums = [], []
        self._loss_scale = loss_scale
        self._after_backward = after_backward
        for chunk in self.chunks:
            chunk.aux_losses.take()
            chunk.aux_losses.weight = aux_weight

    def step_aux_sums(self) -> dict[str, torch.Tensor]:
        """Each auxiliary loss of this step summed over its micro-batches and this rank's stages (0 where none)."""
        sums = {name: torch.zeros((), device=self.ctx.device, dtype=torch.float32) for name in self.aux_names}
        for chunk in self.chunks:  # in stage order; each stage's sum in micro-batch order
            for name, value in chunk.aux_losses.take().items():
                sums[name] += value
        if self.mtp_depth:
            for micro_sum in self._mtp_sums[-self._micro_num :]:  # after shape inference's, as `step_loss_sum`
                sums[MTP] += micro_sum
        return sums

    def step_loss_sum(self, micro_num: int) -> torch.Tensor:
        """The sum of this step's `micro_num` token-loss sums (0 off the last stage)."""
        # The first step's shape inference runs the loss once more, before the schedule: this step's sums are the
        # last micro_num.
        loss_sum = torch.zeros((), device=self.ctx.device, dtype=torch.float32)
        for micro_sum in self._sums[-micro_num:]:  # the order and kernel of the trainer's accumulation
            loss_sum += micro_sum
        return loss_sum

    def reduce_losses(self, values: torch.Tensor) -> None:
        """In place: `values` (a stop flag, the loss: 0 off the last stage, then the auxiliary losses: each stage's
        share) averaged over this stage's data-parallel ranks (under isp its tensor ranks too; under mtp/msp/fsp
        their largest), then summed over the pipeline, so that every rank holds the last stage's average loss, the
        stages' summed auxiliary losses and every stop request."""
        for group, op in ((self._dp_group, dist.ReduceOp.AVG), (self._tp_group, self._tp_op)):
            if group is not None and group.size() > 1:
                dist.all_reduce(values, op=op, group=group)
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self._pp_group)

    def stage_peaks(self, peak: int) -> list[int]:
        """Every pipeline rank's `peak` (of this rank's pipeline: the same data-parallel index), by pipeline rank."""
        mine = torch.tensor([peak], dtype=torch.int64, device=self.ctx.device)
        every = [torch.empty_like(mine) for _ in range(self._pp_group.size())]
        dist.all_gather(every, mine, group=self._pp_group)
        return [int(v) for v in torch.cat(every).tolist()]  # one host sync, not one per rank

    def global_norm(self, stage_norm: torch.Tensor) -> torch.Tensor:
        """The 2-norm over every stage's gradients from this rank's stages' norm (replicated within a stage)."""
        squared = stage_norm.to(torch.float32).square()
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self._pp_group)
        return squared.sqrt()


class PipelineStages(nn.Module):
    """This rank's stages' modules under the whole model's names (`tok_embeddings`, `layers.5`, `norm`, `output`):
    what the optimizer steps and checkpoints hold, so that a checkpoint's parameters and optimizer states read
    at any pipeline layout, or without one. The schedule runs the (wrapped) stage modules themselves."""

    def __init__(self, chunks: dict[int, PipelineChunk]) -> None:
        super().__init__()
        ordered = [chunks[s] for s in sorted(chunks)]  # the whole model's order: embedding, blocks, norm, head
        embedding = next((c.tok_embeddings for c in ordered if c.tok_embeddings is not None), None)
        if embedding is not None:
            self.tok_embeddings = embedding
        self.layers = nn.ModuleDict({name: block for c in ordered for name, block in c.layers.items()})
        last = next((c for c in ordered if c.last), None)
        if last is not None:
            self.norm, self.output = last.norm, last.output
            if last.mtp is not None:
                self.mtp = last.mtp


def wrap_chunks(
    ctx: RunContext,
    chunks: dict[int, nn.Module],
    *,
    mode: str,
    bucket_cap_mb: int = 25,
    reshard_after_forward: bool = True,
    mixed_precision: MixedPrecisionPolicy | None = None,
    over_tensor: bool = False,
) -> dict[int, nn.Module]:
    """Each chunk data parallel over its stage's "dp" ranks (with `over_tensor`, isp, its "dp" and "tp" ranks):
    `mode` "none", "ddp", or "fsdp2" (each block its own unit, then the chunk, under `mixed_precision`: fp32
    shards as masters; under mtp/msp/fsp the tensor shards stay inside); by stage index."""
    mesh = stage_data_mesh(ctx, over_tensor)
    if mode == "fsdp2":
        return {index: _shard(chunk, mesh, reshard_after_forward, mixed_precision) for index, chunk in chunks.items()}
    if mode == "none":
        return dict(chunks)
    dp_group = mesh.get_group()
    device_ids = None if ctx.accelerator.name == "cpu" else [ctx.local_rank]
    wrapped: dict[int, nn.Module] = {}
    for index, chunk in chunks.items():
        module = DistributedDataParallel(
            chunk, device_ids=device_ids, process_group=dp_group, bucket_cap_mb=bucket_cap_mb
        )
        # Held in no_sync's state: the stage arms the reducer itself before the step's last backward. torch's
        # first-step shape inference runs a forward through DDP and no parameter backward; a reducer armed by
        # that forward would count the micro-batches' gradients twice and fail the next forward (reducer.cpp:
        # "rebuilt parameter indices size is not same as original model parameters size").
        module.require_backward_grad_sync = False
        wrapped[index] = module
    return wrapped


def _shard(
    chunk: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool, mixed_precision: MixedPrecisionPolicy | None
) -> nn.Module:
    """FSDP2 over the stage's data-parallel ranks, each block a unit as without a pipeline. torch's stage holds
    gradient reduction until the step's last backward (the gradients accumulate unsharded over micro-batches) and
    reduce-scatters once; the chunk itself keeps its parameters after forward, backward needs them at once."""
    policy = {} if mixed_precision is None else {"mp_policy": mixed_precision}
    mtp = chunk.mtp.layers if chunk.mtp is not None else ()  # as without a pipeline: builder/model.py fsdp_blocks
    for block in [*chunk.layers.values(), *mtp]:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, **policy)
    return fully_shard(chunk, mesh=mesh, reshard_after_forward=False, **policy)
