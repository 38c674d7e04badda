"""The training loop: forward/backward over micro-batches, clip, step, log, checkpoint.

The trainer is handed ready components by the builder and does not know which memory features
(checkpointing, activation offload, swapped optimizer states) are on: they live inside the model
and the optimizer it is given.
"""

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from internlm_offload.data import StepLoader
from internlm_offload.engine.checkpoint import CheckpointManager
from internlm_offload.engine.metrics import MetricsLog, Progress, memory_record
from internlm_offload.engine.runtime import RunContext
from internlm_offload.log import get_logger

logger = get_logger(__name__)


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


class Trainer:
    # components (injected by the builder)
    ctx: RunContext
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: StepLoader
    checkpoints: CheckpointManager
    metrics: MetricsLog | None  # rank 0 only
    settings: TrainerSettings
    extra_metrics: list[Callable[[], dict[str, float]]]  # figures of the memory features, if any
    # training state (checkpointed)
    step: int
    tokens_seen: int

    def __init__(
        self,
        *,
        ctx: RunContext,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        loader: StepLoader,
        checkpoints: CheckpointManager,
        metrics: MetricsLog | None,
        settings: TrainerSettings,
        extra_metrics: list[Callable[[], dict[str, float]]] | None = None,
    ) -> None:
        self.ctx = ctx
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loader = loader
        self.checkpoints = checkpoints
        self.metrics = metrics
        self.settings = settings
        self.extra_metrics = extra_metrics or []
        self.step = 0
        self.tokens_seen = 0
        self._last_saved_step = -1

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
        }

    def resume_from(self, path: Path) -> None:
        state = self.checkpoints.load(path, model=self.model, optimizer=self.optimizer)
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.loader.load_state_dict(state["sampler"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._last_saved_step = self.step
        if self.metrics is not None:
            self.metrics.truncate_after(self.step)
        if state.get("config_fingerprint") != self.settings.config_fingerprint:
            logger.warning("resuming with a config that differs from the checkpoint's")

    def save_checkpoint(self) -> None:
        self.checkpoints.save(self.step, model=self.model, optimizer=self.optimizer, train_state=self.train_state())
        self._last_saved_step = self.step

    # ------------------------------------------------------------------ one step

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor, token_scale: float) -> torch.Tensor:
        """Loss of one micro-batch, backpropagated with its share of the step's token mean."""
        input_ids = input_ids.to(self.ctx.device, non_blocking=True)
        labels = labels.to(self.ctx.device, non_blocking=True)
        logits = self.model(input_ids)  # (B, T, V)
        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        (loss_sum * token_scale).backward()
        return loss_sum.detach()

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """One optimizer step over this rank's micro-batches; returns (global mean loss, grad norm)."""
        tokens_per_rank = sum(labels.numel() for _, labels in micro_batches)
        # Each rank scales by its own token count; DDP/FSDP2 then average over ranks: a global token mean.
        token_scale = 1.0 / tokens_per_rank
        loss_sum = torch.zeros((), device=self.ctx.device, dtype=torch.float32)
        for i, (input_ids, labels) in enumerate(micro_batches):
            with gradient_sync(self.model, enabled=i == len(micro_batches) - 1):
                loss_sum += self.forward_backward(input_ids, labels, token_scale)
        grad_norm = self.clip_gradients()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_sum / tokens_per_rank
        if self.ctx.distributed:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        return loss.item(), grad_norm  # .item(): the one host sync per step

    def clip_gradients(self) -> float:
        max_norm = self.settings.clip_grad_norm or float("inf")  # inf: scale 1.0, grads unchanged
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor over the shards
            norm = norm.full_tensor()
        return norm.item()

    # ------------------------------------------------------------------ loop

    def train(self) -> None:
        settings = self.settings
        progress = Progress(
            total=settings.total_steps, initial=self.step, enabled=self.ctx.is_main,
            mode=settings.progress_bar, log_every=settings.log_every,
        )  # fmt: skip
        tokens_per_step = self.loader.tokens_per_step_global
        try:
            for micro_batches in self._batches():
                self.ctx.accelerator.reset_peak_memory_stats()
                start = time.perf_counter()
                lr = self.optimizer.param_groups[0]["lr"]
                loss, grad_norm = self.train_step(micro_batches)
                step_time = time.perf_counter() - start
                self.step += 1
                self.tokens_seen += tokens_per_step
                record = {
                    "step": self.step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
                    "tokens": self.tokens_seen, "tokens_per_s": tokens_per_step / step_time,
                    "step_time_s": step_time, **memory_record(self.ctx.accelerator),
                }  # fmt: skip
                for source in self.extra_metrics:
                    record.update(source())
                if self.metrics is not None:
                    self.metrics.write(record)
                progress.update(self.step, record)
                if self._checkpoint_due():
                    self.save_checkpoint()
        finally:
            progress.close()
        if settings.save_checkpoints and self._last_saved_step != self.step:
            self.save_checkpoint()

    def _batches(self) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        while self.step < self.settings.total_steps:
            yield self.loader.next_step()

    def _checkpoint_due(self) -> bool:
        every = self.settings.checkpoint_every
        return self.settings.save_checkpoints and every > 0 and self.step % every == 0


def gradient_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce on all but the last micro-batch of a step (DDP and FSDP2)."""
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()
