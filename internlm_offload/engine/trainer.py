"""The training loop: forward/backward over micro-batches, clip, step, log, checkpoint.

The trainer is handed ready components by the builder and does not know which memory features
(checkpointing, activation offload, swapped optimizer states) are on: they live inside the model
and the optimizer it is given, and it sees them only as `MemoryFeature`s (figures, teardown) and
through the optimizer interface, whose calls are no-ops where a feature is off.
"""

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from internlm_offload.config import ModelConfig
from internlm_offload.data import StepLoader
from internlm_offload.data.loader import MicroBatch
from internlm_offload.data.tokenized import IGNORE_INDEX
from internlm_offload.engine.checkpoint import CheckpointManager
from internlm_offload.engine.evaluation import Evaluator
from internlm_offload.engine.interrupts import GracefulStop
from internlm_offload.engine.loss import mtp_labels, mtp_token_counts, token_loss_sum, weighted_aux_losses
from internlm_offload.engine.loss_scaler import DynamicLossScaler
from internlm_offload.engine.metrics import MetricsLog, Progress, memory_record
from internlm_offload.engine.pipeline import PipelineRunner
from internlm_offload.engine.profiling import profiled_step
from internlm_offload.engine.runtime import RunContext
from internlm_offload.engine.sequence_parallel import SequenceShard
from internlm_offload.engine.tensor_parallel import local_loss, loss_context
from internlm_offload.errors import TrainingDiverged
from internlm_offload.features import MemoryFeature
from internlm_offload.log import get_logger
from internlm_offload.model.output import MTP
from internlm_offload.optim.dtensor import is_dtensor, local_shard
from internlm_offload.optim.interface import OffloadOptimizer
from internlm_offload.optim.lr_scheduler import load_scheduler_state
from internlm_offload.optim.records import Masters
from internlm_offload.optim.rules import RULE_KEY
from internlm_offload.weights.sources import WeightsSource, load_weights

logger = get_logger(__name__)

# Steps (counted from the run's start) whose larger device peak the memory line reports: the first also
# creates the optimizer states, and on cpu one sampled step can miss a sub-millisecond transient.
LINE_STEPS = (2, 3)


@dataclass(frozen=True)
class TrainerSettings:
    """The plain values the loop needs from the config."""

    total_steps: int
    clip_grad_norm: float  # 0: measure the norm, do not clip
    checkpoint_every: int  # 0: only at the end
    save_checkpoints: bool
    log_every: int
    progress_bar: str
    config: dict[str, Any]  # the resolved config, stored in every checkpoint
    config_fingerprint: str
    max_skipped_steps: int = 20  # consecutive non-finite steps before the run stops
    label_smoothing: float = 0.0
    valid_every: int = 0  # validate after every N-th step; 0: never
    skip_batches: tuple[tuple[int, int], ...] = ()  # inclusive ranges of data-stream batch indices to discard
    predicted_device_peak_bytes: int | None = None  # the planner's steady-step peak, logged beside the measured
    # update rules whose gradients count in the clipping norm but are not scaled (XTuner's Muon: ("muon",))
    unclipped_rules: tuple[str, ...] = ()
    runtime_memory_bytes: int = 0  # the runtime's own, measured at start-up; in neither figure, logged with them
    loss_parallel: bool = False  # tensor parallel with vocab-sharded logits: forward, loss and backward under it
    # mtp/msp/fsp with whole experts: the tensor ranks whose chunks' MoE aux losses one objective adds up (their
    # gradients summed over "tp"); each is weighted by 1/aux_chunks, their mean as InternEvo averages it
    aux_chunks: int = 1
    profile_step: int = 0  # run this step under torch.profiler; 0: never
    profile_dir: Path | None = None  # where its traces go
    mtp_depth: int = 0  # the model's multi-token-prediction depths (model.mtp_config.num_layers); 0: none
    mtp_loss_scaling: float = 0.0  # λ: the objective adds λ x the mean over depths of their token-mean losses


@dataclass(frozen=True)
class StepResult:
    loss: float  # global token-mean loss
    grad_norm: float  # before clipping, after loss-scale removal
    skipped: bool  # non-finite loss or grad norm: the update was not applied
    # each auxiliary loss (MoE router load balancing: `moe_aux`) by name, weighted, mean over micro-batches; and
    # multi-token prediction's (`mtp`): λ x the mean over depths of their token-mean losses
    aux_losses: dict[str, float] = field(default_factory=dict)
    stop: bool = False  # some rank received SIGTERM/SIGINT: checkpoint after this step and return
    loss_scale: float | None = None  # fp16: the loss scale this step used


def aux_metric(name: str) -> str:
    """The metrics key of auxiliary loss `name`: `moe_aux` logs as `moe_aux_loss`."""
    return f"{name}_loss"


class Trainer:
    # components (injected by the builder)
    ctx: RunContext
    model: nn.Module
    optimizer: OffloadOptimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: StepLoader
    checkpoints: CheckpointManager
    metrics: MetricsLog | None  # rank 0 only
    settings: TrainerSettings
    features: list[MemoryFeature]  # offloaders, the optimizer, monitors: per-step work, figures and teardown
    masters: Masters  # explicit fp32 masters (low precision outside FSDP2), or NoMasters over the model
    scaler: DynamicLossScaler | None  # fp16 loss scaling
    evaluator: Evaluator | None  # validation sets, if any
    # training state (checkpointed)
    step: int
    tokens_seen: int
    skipped_steps: int
    consecutive_skips: int

    def __init__(
        self,
        *,
        ctx: RunContext,
        model: nn.Module,
        optimizer: OffloadOptimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        loader: StepLoader,
        checkpoints: CheckpointManager,
        metrics: MetricsLog | None,
        settings: TrainerSettings,
        masters: Masters,
        features: Sequence[MemoryFeature] = (),
        scaler: DynamicLossScaler | None = None,
        evaluator: Evaluator | None = None,
        sequence_shard: SequenceShard | None = None,
        pipeline: PipelineRunner | None = None,
        aux_loss_coefficients: Mapping[str, float] = MappingProxyType({}),
    ) -> None:
        """`sequence_shard` (isp): the model returns this rank's chunk of the sequence; the loss takes the
        matching labels, weighted by the chunk count (the wrapper averages over every rank). `pipeline`: the
        model is this rank's pipeline stages; their schedule runs the micro-batches (engine/pipeline.py).
        `aux_loss_coefficients`: the weight of each auxiliary loss the model returns, by name."""
        self.ctx = ctx
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loader = loader
        self.checkpoints = checkpoints
        self.metrics = metrics
        self.settings = settings
        self.features = list(features)
        self.masters = masters
        self.scaler = scaler
        self.evaluator = evaluator
        self.sequence_shard = sequence_shard
        self.pipeline = pipeline
        self.aux_loss_coefficients = dict(aux_loss_coefficients)
        self._chunks = sequence_shard.size if sequence_shard is not None else 1
        self._closed = False
        self._line_peaks: list[int] = []  # the device peaks of LINE_STEPS so far
        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.stopped_by: str | None = None  # the signal that stopped `train()` early, if any
        self._last_saved_step = -1
        self._stop = GracefulStop()

    @property
    def state_module(self) -> nn.Module:
        """The module whose parameters the optimizer steps and checkpoints hold: the fp32 masters if any."""
        return self.masters.module

    # ------------------------------------------------------------------ state

    def train_state(self) -> dict[str, Any]:
        """Everything besides model and optimizer that a bitwise resume needs (plain types only)."""
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "sampler": self.loader.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "config": self.settings.config,
            "config_fingerprint": self.settings.config_fingerprint,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def resume_from(self, path: Path) -> None:
        state = self.checkpoints.load(path, model=self.state_module, optimizer=self.optimizer)
        self.masters.copy_to_model()
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.loader.load_state_dict(state["sampler"])
        load_scheduler_state(self.scheduler, state["scheduler"])
        self.skipped_steps = state.get("skipped_steps", 0)
        self.consecutive_skips = state.get("consecutive_skips", 0)
        if self.scaler is not None and state.get("loss_scaler") is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        self._last_saved_step = self.step
        if self.metrics is not None:
            self.metrics.truncate_after(self.step)
        if state.get("config_fingerprint") != self.settings.config_fingerprint:
            logger.warning("resuming with a config that differs from the checkpoint's")

    def load_weights_from(self, source: WeightsSource, model: ModelConfig) -> None:
        """Start this run from another run's weights (this trainer's checkpoint or another trainer's folder,
        for the model `model`): step 0, fresh optimizer, schedule and data order."""
        if source.kind == "dcp":
            self.checkpoints.load_model(source.path, model=self.state_module)
        else:
            load_weights(self.state_module, source, model)
        self.masters.copy_to_model()

    def save_checkpoint(self) -> None:
        if self.consecutive_skips:
            # The state after a skipped step is suspect; keep the last good checkpoints rather than prune them.
            logger.warning("step %d: not saving a checkpoint after a skipped (non-finite) step", self.step)
            return
        self.optimizer.finish_copies()  # host-resident masters/states may still be landing
        if not all_finite(self.state_module.parameters(), distributed=self.ctx.distributed):
            raise TrainingDiverged(
                f"step {self.step}: the weights hold non-finite values; no checkpoint written, the last good one "
                f"stays in {self.checkpoints.folder}"
            )
        self.checkpoints.save(
            self.step, model=self.state_module, optimizer=self.optimizer, train_state=self.train_state()
        )
        self._last_saved_step = self.step

    def close(self) -> None:
        """Release what the run's components hold (offload hooks, copy streams, host buffers); idempotent.

        The memory features first, in order (hooks and pools, then the optimizer's streams), then every copy
        stream of the run. The trainer cannot train afterwards. `launch` calls it whether the run ended or failed.
        """
        if self._closed:
            return
        self._closed = True
        for feature in self.features:
            feature.close()
        self.ctx.accelerator.close_streams()
        if self.metrics is not None:
            self.metrics.close()

    # ------------------------------------------------------------------ one step

    def forward_backward(
        self,
        micro_batch: MicroBatch,
        token_weight: float,
        aux_weight: float,
        on_backward_start: Callable[[], None] | None = None,
        *,
        mtp_weights: Sequence[float] = (),
        loss_scale: float = 1.0,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss sum and weighted auxiliary losses (by name) of one micro-batch; backpropagates their weighted sum.

        A micro-batch is (input_ids, labels) or, with packed documents kept apart, (input_ids, labels,
        position_ids). The model returns a `ModelOutput`: logits (B, T, V) and its auxiliary losses unweighted,
        each weighed here by its coefficient. Labels of -100 carry no loss. `on_backward_start` runs once backward
        begins. Multi-token prediction's depth k (`ModelOutput.mtp_logits`) is scored against the labels rolled by k
        inside each document and weighed by `mtp_weights[k - 1]` (times `loss_scale` in the objective); their
        weighted sum comes back as the auxiliary loss `mtp`.
        """
        input_ids, labels, *positions = (t.to(self.ctx.device, non_blocking=True) for t in micro_batch)
        with loss_context(self.settings.loss_parallel):
            out = self.model(input_ids, *positions)
            if len(out.mtp_logits) != len(mtp_weights):
                raise ValueError(
                    f"the model returned {len(out.mtp_logits)} multi-token-prediction depths, weights were given for "
                    f"{len(mtp_weights)} (TrainerSettings.mtp_depth)"
                )
            # rolled on the whole sequence, before the split (isp), as the model rolls the tokens
            depth_labels = mtp_labels(labels, positions[0] if positions else None, len(out.mtp_logits))
            if self.sequence_shard is not None:
                labels = self.sequence_shard.local(labels)  # shifted before the split, as the tokens were
                depth_labels = [self.sequence_shard.local(rolled) for rolled in depth_labels]
            loss_sum = token_loss_sum(out.logits, labels, label_smoothing=self.settings.label_smoothing)
            aux_losses = weighted_aux_losses(out.aux_losses, self.aux_loss_coefficients)
            objective = loss_sum * token_weight
            logged = {name: loss.detach() for name, loss in aux_losses.items()}
            if out.mtp_logits:
                mtp = sum(
                    token_loss_sum(logits, rolled, label_smoothing=self.settings.label_smoothing) * weight
                    for logits, rolled, weight in zip(out.mtp_logits, depth_labels, mtp_weights, strict=True)
                )
                objective = objective + mtp * loss_scale
                logged[MTP] = local_loss(mtp).detach()
            apart = []  # a rank's own aux loss beside a replicated DTensor loss (mtp/msp/fsp): two roots, no mix
            for aux_loss in aux_losses.values():
                if is_dtensor(objective):
                    apart.append(aux_loss * aux_weight)
                else:
                    objective = objective + aux_loss * aux_weight
            if on_backward_start is not None:
                objective.register_hook(lambda _: on_backward_start())  # the first grad backward computes
            torch.autograd.backward([objective, *apart])
        return local_loss(loss_sum).detach(), logged

    def train_step(self, micro_batches: list[MicroBatch]) -> StepResult:
        """One optimizer step over this rank's micro-batches; skipped when the loss or grad norm is not finite."""
        # Labels are still on the host: counting them costs no device sync.
        tokens_per_rank = max(1, sum(int((mb[1] != IGNORE_INDEX).sum()) for mb in micro_batches))
        loss_scale = self.scaler.scale if self.scaler is not None else 1.0
        mtp_weights = self.mtp_weights(micro_batches)
        # Each rank weighs by its own count of labelled tokens; the gradient reduction then averages over
        # ranks: a global token mean when ranks hold equally many labelled tokens (always, without -100
        # labels). The aux losses (per-micro-batch means) are averaged over micro-batches. fp16 multiplies
        # both by the loss scale, removed again before clipping.
        # isp: a rank's loss is its chunk's share of the sequences; times the chunk count, the wrapper's average
        # over all ranks sums the chunks of a sequence and averages the data-parallel ranks.
        token_weight = loss_scale * self._chunks / tokens_per_rank
        aux_weight = loss_scale / len(micro_batches) / self.settings.aux_chunks
        if self.pipeline is not None:  # the schedule runs every micro-batch through this rank's stages
            # each stage backpropagates its own blocks' aux losses; `aux_sums`: this rank's stages' share
            loss_sum, aux_sums = self.pipeline.forward_backward(
                micro_batches,
                token_weight,
                aux_weight,
                self.masters.accumulate_grads,
                mtp_weights=mtp_weights,
                loss_scale=loss_scale,
            )
        else:
            loss_sum, aux_sums = self._micro_batches(micro_batches, token_weight, aux_weight, mtp_weights, loss_scale)
        self.masters.reduce_grads(self.ctx.distributed)
        for feature in self.features:  # per-step work before clipping (the router bias update)
            feature.after_backward()
        # the aux losses' mean over micro-batches; multi-token prediction's sum, each micro-batch's already over the
        # step's tokens (`mtp_weights`)
        aux_means = (aux if name == MTP else aux / len(micro_batches) for name, aux in aux_sums.items())
        losses = [loss_sum * self._chunks / tokens_per_rank, *aux_means]
        # Stop requests ride on the loss all-reduce: every rank sees the same (averaged) flag, so all stop
        # after the same step. The flag goes first so that the loss stays at index 1.
        stop_flag = torch.tensor(float(self._stop.requested), device=self.ctx.device)
        loss = torch.stack([stop_flag, *losses])
        if self.pipeline is not None:  # the loss exists on the last stage only
            self.pipeline.reduce_losses(loss)
        elif self.ctx.distributed:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        norm = self.clip_gradients(unscale=1.0 / loss_scale)
        values = self.read_floats(torch.cat([loss, norm.to(loss.device, torch.float32).reshape(1)]))
        stop, loss_value, norm_value = values[0] > 0, values[1], values[-1]
        aux_values = dict(zip(aux_sums, values[2:-1], strict=True))
        skipped = not (math.isfinite(loss_value) and math.isfinite(norm_value))
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()  # as InternEvo: the schedule advances with successful updates only
            self.masters.after_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.masters.release_grads()
        if self.scaler is not None:
            self.scaler.update(overflow=skipped)
        used_scale = loss_scale if self.scaler is not None else None
        return StepResult(loss_value, norm_value, skipped, aux_values, stop, used_scale)

    def mtp_weights(self, micro_batches: list[MicroBatch]) -> tuple[float, ...]:
        """Each multi-token-prediction depth's weight on its loss sum: λ / D x the chunk count / this rank's labelled
        tokens of that depth (as the language model's: the wrapper's average over ranks then gives the global mean,
        λ x the mean over depths of their token means). Counted on the host, as the language model's."""
        depth = self.settings.mtp_depth
        if not depth:
            return ()
        scale = self.settings.mtp_loss_scaling / depth * self._chunks
        return tuple(scale / count for count in mtp_token_counts(micro_batches, depth))

    def _micro_batches(
        self,
        micro_batches: list[MicroBatch],
        token_weight: float,
        aux_weight: float,
        mtp_weights: tuple[float, ...] = (),
        loss_scale: float = 1.0,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and backward of each micro-batch in turn; the sum of their loss sums and of each aux loss."""
        sync_in_backward = self.masters.reduce_in_backward
        loss_sum = torch.zeros((), device=self.ctx.device, dtype=torch.float32)
        aux_sums: dict[str, torch.Tensor] = {}
        for i, micro_batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            # SwapAdamW copies its first chunk of states in while the last backward runs (a no-op for the others).
            prefetch = self.optimizer.prefetch if last else None
            with gradient_sync(self.model, enabled=sync_in_backward and last):
                micro_loss, micro_aux = self.forward_backward(
                    micro_batch, token_weight, aux_weight, prefetch, mtp_weights=mtp_weights, loss_scale=loss_scale
                )
            loss_sum += micro_loss
            for name, aux in micro_aux.items():
                aux_sums[name] = aux_sums[name] + aux if name in aux_sums else aux
            self.masters.accumulate_grads()  # fp32 accumulation over micro-batches
        return loss_sum, aux_sums

    def read_floats(self, values: torch.Tensor) -> list[float]:
        """The step's one host sync: the loss, flags and grad norm as Python floats (the planner's trace,
        which has no values, overrides it)."""
        return values.tolist()

    def clip_gradients(self, unscale: float = 1.0) -> torch.Tensor:
        """Remove the loss scale, clip to the configured norm; returns the norm before clipping (a tensor)."""
        max_norm = self.settings.clip_grad_norm or float("inf")  # inf: scale 1.0, grads unchanged
        groups = by_mesh(self.masters.grads())
        if unscale != 1.0:
            for group in groups.values():  # per mesh: torch's foreach kernels take no mix of DTensors and tensors
                torch._foreach_mul_(group, unscale)  # a power of two: exact
        norm = total_norm(groups)
        if self.pipeline is not None:  # every stage clips by the norm over all stages
            norm = self.pipeline.global_norm(norm)
        # clip_grad_norm_'s own rule and kernels, applied to the grad tensors (masters' grads need not be `.grad`);
        # per mesh, as torch's foreach kernels take no mix of DTensors and plain tensors
        unclipped = self._unclipped_grads()
        for group in groups.values():
            clipped = [_GradHolder(g) for g in group if local_shard(g).data_ptr() not in unclipped]
            torch.nn.utils.clip_grads_with_norm_(clipped, max_norm, norm)
        return norm

    def _unclipped_grads(self) -> set[int]:
        """Addresses of the gradients clipping leaves alone: those of the params stepped by `unclipped_rules`
        (found by the master each gradient record belongs to, so in every tier alike); empty by default."""
        if not self.settings.unclipped_rules:
            return set()
        rules = self.settings.unclipped_rules
        owned = {id(p) for g in self.optimizer.param_groups if g.get(RULE_KEY) in rules for p in g["params"]}
        grads = [record.grad() for record in self.masters.records() if id(record.master) in owned]
        return {local_shard(grad).data_ptr() for grad in grads if grad is not None and grad.numel()}

    # ------------------------------------------------------------------ loop

    def _note_peak(self, run_step: int, peak: int) -> None:
        """Log the larger device peak of the run's `LINE_STEPS` beside the prediction, once; a run shorter
        than that logs its last step's."""
        if run_step in LINE_STEPS:
            self._line_peaks.append(peak)
        if run_step == LINE_STEPS[-1] or (self.step == self.settings.total_steps and run_step < LINE_STEPS[-1]):
            steps = [self.step - run_step + s for s in LINE_STEPS if s <= run_step] or [self.step]
            self._log_peak_against_prediction(steps, max(self._line_peaks, default=peak))

    def _log_peak_against_prediction(self, steps: list[int], measured: int) -> None:
        predicted = self.settings.predicted_device_peak_bytes
        if predicted is not None and measured > 0:
            logger.info(
                "Memory: device peak of %s measured %.1f MiB, predicted %.1f MiB (%+.1f %%); the runtime's "
                "own %.1f MiB (measured at start-up) comes on top of both",
                f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}",
                measured / 2**20,
                predicted / 2**20,
                100 * (predicted / measured - 1),
                self.settings.runtime_memory_bytes / 2**20,
            )

    def train(self) -> None:
        settings = self.settings
        if settings.save_checkpoints:  # a run that cannot save says so now, not after hours
            self.checkpoints.check_space(self.checkpoints.expected_bytes(self.state_module))
        progress = Progress(
            total=settings.total_steps,
            initial=self.step,
            enabled=self.ctx.is_main,
            mode=settings.progress_bar,
            log_every=settings.log_every,
        )
        tokens_per_step = self.loader.tokens_per_step_global
        try:
            with self._stop:
                self._train_loop(progress, tokens_per_step)
        finally:
            progress.close()
        if settings.save_checkpoints and self._last_saved_step != self.step:
            self.save_checkpoint()

    def _train_loop(self, progress: Progress, tokens_per_step: int) -> None:
        first_step = self.step
        for micro_batches in self._batches():
            self.ctx.accelerator.reset_peak_memory_stats()
            start = time.perf_counter()
            lr = self.optimizer.param_groups[0]["lr"]
            with self._profiled(self.step + 1):
                result = self.train_step(micro_batches)
            step_time = time.perf_counter() - start
            self.step += 1
            self.tokens_seen += tokens_per_step
            self._count_skip(result)
            record = {
                "step": self.step,
                "loss": result.loss,
                "grad_norm": result.grad_norm,
                "lr": lr,
                "tokens": self.tokens_seen,
                "tokens_per_s": tokens_per_step / step_time,
                "step_time_s": step_time,
                "skipped": result.skipped,
                "skipped_steps": self.skipped_steps,
                **({"loss_scale": result.loss_scale} if result.loss_scale is not None else {}),
                **{aux_metric(name): value for name, value in result.aux_losses.items()},
                **memory_record(self.ctx.accelerator),
            }
            self._note_peak(self.step - first_step, record["device_peak_mem_bytes"])
            if self.pipeline is not None:  # the stages' peaks differ (the first holds the most micro-batches)
                record["stage_device_peak_mem_bytes"] = self.pipeline.stage_peaks(record["device_peak_mem_bytes"])
            for feature in self.features:
                record.update(feature.metrics())
            if self._validation_due():
                record.update(self.validate())
            if self.metrics is not None:
                self.metrics.write(record)
            progress.update(self.step, record)
            self._stop_if_diverged(result)
            if self._checkpoint_due():
                self.save_checkpoint()
            if result.stop:
                self.stopped_by = self._stop.signal_name or "a signal on another rank"
                return

    def _profiled(self, step: int) -> contextlib.AbstractContextManager:
        settings = self.settings
        if settings.profile_dir is None:
            return contextlib.nullcontext()
        return profiled_step(
            step,
            profile_step=settings.profile_step,
            out_dir=settings.profile_dir,
            accelerator=self.ctx.accelerator,
            rank=self.ctx.rank,
        )

    def _count_skip(self, result: StepResult) -> None:
        if not result.skipped:
            self.consecutive_skips = 0
            return
        self.skipped_steps += 1
        self.consecutive_skips += 1
        logger.warning(
            "step %d: non-finite loss=%s or grad_norm=%s; update skipped (%d in a row)",
            self.step,
            result.loss,
            result.grad_norm,
            self.consecutive_skips,
        )

    def _stop_if_diverged(self, result: StepResult) -> None:
        limit = self.settings.max_skipped_steps
        if self.consecutive_skips < limit:
            return
        last_good = self._last_saved_step if self._last_saved_step >= 0 else None
        kept = f"last checkpoint kept: step {last_good}" if last_good is not None else "no checkpoint written"
        raise TrainingDiverged(
            f"step {self.step}: {limit} consecutive steps with a non-finite loss or gradient norm "
            f"(last loss={result.loss}, grad_norm={result.grad_norm}); the run diverged, {kept}. "
            "Lower adam.lr, or raise max_skipped_steps"
        )

    def _batches(self) -> Iterator[list[MicroBatch]]:
        while self.step < self.settings.total_steps:
            index = self.loader.batches_drawn
            batch = self.loader.next_step()
            if any(first <= index <= last for first, last in self.settings.skip_batches):
                if self.ctx.is_main:
                    logger.info("data.skip_batches: batch %d discarded", index)
                continue
            yield batch

    def validate(self) -> dict[str, float]:
        """Loss and perplexity on the validation sets (every rank takes part), logged on the main rank."""
        result = self.evaluator.evaluate(self.model)
        if self.ctx.is_main:
            logger.info("step %d: %s", self.step, ", ".join(f"{k}={v:.4f}" for k, v in result.items()))
        return result

    def _validation_due(self) -> bool:
        every = self.settings.valid_every
        return self.evaluator is not None and every > 0 and self.step % every == 0

    def _checkpoint_due(self) -> bool:
        every = self.settings.checkpoint_every
        return self.settings.save_checkpoints and every > 0 and self.step % every == 0


class _GradHolder:
    """Presents a gradient tensor as a parameter's `.grad` to torch's clipping utilities."""

    __slots__ = ("grad",)

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad


def by_mesh(tensors: list[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    """`tensors` grouped by their DTensor mesh (None: plain tensors), in first-seen order."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device_mesh if is_dtensor(tensor) else None, []).append(tensor)
    return groups


def total_norm(groups: dict[Any, list[torch.Tensor]]) -> torch.Tensor:
    """The 2-norm of all gradients (`by_mesh`'s groups) as a plain tensor. DTensors (FSDP2 shards,
    tensor-parallel shards) are normed per mesh and gathered: torch cannot stack norms of different meshes,
    or of DTensors and plain tensors (the replicated norms of mtp)."""
    norms = []
    for mesh, group in groups.items():
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if mesh is not None else norm)
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


def all_finite(tensors: Iterator[torch.Tensor], *, distributed: bool) -> bool:
    """Whether every element of every tensor (this rank's shard of a DTensor) is finite, on all ranks."""
    local = [local_shard(t) for t in tensors]
    finite = torch.stack([t.detach().isfinite().all() for t in local]).all().to(torch.int32)
    if distributed:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite.item())


def gradient_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Skip DDP's gradient all-reduce on all but the last micro-batch of a step.

    FSDP2 reduce-scatters every micro-batch and accumulates the sharded grads, as torchtitan does:
    skipping it would keep every block's unsharded gradient (fp32 under mixed precision) until the last
    micro-batch, the whole model's on every rank (28.8 GiB at 7B), which sharding exists to avoid. The
    price is one reduce-scatter per micro-batch instead of one per step.
    """
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if enabled else model.no_sync()
    return contextlib.nullcontext()
