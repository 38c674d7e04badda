"""The builder's layer plan: disabled or zero-layer offload changes nothing at all."""

import functools

import pytest
import torch

from internlm_offload.builder import build_layer_plan, offload_settings
from internlm_offload.config import resolve_config
from internlm_offload.device import Accelerator
from internlm_offload.model import InternLM2
from internlm_offload.offload import apply_layer_plan


def apply_with(model: InternLM2, plan, offloading):
    """The builder's call: the plan with the `cpu_offloading` settings."""
    return apply_layer_plan(model.layers, plan, **offload_settings(offloading), accelerator=Accelerator("cpu"))


def tiny_model() -> InternLM2:
    torch.manual_seed(0)
    return InternLM2(num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=259)


@pytest.mark.parametrize("offloading", [dict(enable=False, num_layers=0), dict(enable=True, num_layers=0)])
def test_no_offload_installs_nothing(offloading):
    cfg = resolve_config({"model": {"num_layers": 4, "hidden_size": 64}, "cpu_offloading": offloading})
    model = tiny_model()
    plan = build_layer_plan(cfg, len(model.layers))
    offloader, selective = apply_with(model, plan, cfg.cpu_offloading)
    assert offloader is None and selective is None
    for layer in model.layers:
        assert not layer._forward_pre_hooks and not layer._forward_hooks


def test_plan_applies_every_mode():
    raw = {
        "model": {"num_layers": 4, "hidden_size": 64, "checkpoint": 1.0},
        "cpu_offloading": {"enable": True, "num_layers": 1},
        "selective_checkpoint": True,
        "selective_checkpoint_offload": True,
    }
    cfg = resolve_config(raw)
    model = tiny_model()
    plan = build_layer_plan(cfg, len(model.layers))
    assert [m.value for m in plan.modes] == ["offload", "selective+offload", "selective+offload", "selective+offload"]
    offloader, selective = apply_with(model, plan, cfg.cpu_offloading)
    assert offloader is not None and offloader.num_layers == 1 and selective is not None


def test_trainer_close_releases_hooks_streams_and_host_buffers(tmp_path):
    """Activation offload, selective offload and the swap optimizer in one run: close() leaves nothing behind."""

    from internlm_offload.builder import build_trainer
    from internlm_offload.config import resolve_config
    from internlm_offload.device import Accelerator
    from internlm_offload.engine.runtime import RunContext

    cfg = resolve_config(
        {
            "model": dict(num_layers=4, hidden_size=64, num_attention_heads=4, checkpoint=0.75),
            "cpu_offloading": dict(enable=True, num_layers=1),
            "selective_checkpoint": True,
            "selective_checkpoint_offload": True,
            "swap_optimizer": True,
            "data": dict(seq_len=32, total_steps=1),
            "ckpt": dict(enable_save_ckpt=False),
            "monitor": dict(progress_bar="off"),
        }
    )
    accelerator = Accelerator("cpu")
    ctx = RunContext(rank=0, local_rank=0, world_size=1, accelerator=accelerator)
    trainer = build_trainer(cfg, ctx, tmp_path)
    trainer.train()
    layers = trainer.model.layers
    assert layers[0]._forward_hooks and trainer.metrics is not None
    streams = accelerator._streams.side_streams()
    assert streams and any(s._thread is not None and s._thread.is_alive() for s in streams)
    trainer.close()
    assert not layers[0]._forward_hooks and not layers[0]._forward_pre_hooks  # the offloader's hooks
    assert all(s.closed and (s._thread is None or not s._thread.is_alive()) for s in streams)
    trainer.close()  # idempotent


def test_swap_optimizer_prefetches_once_per_step_inside_the_last_backward(tmp_path, monkeypatch):
    """The trainer starts SwapAdamW's first copy-in when the last micro-batch's backward begins."""
    from internlm_offload.builder import build_trainer
    from internlm_offload.engine.runtime import RunContext
    from internlm_offload.optim.swap import SwapAdamW

    calls = []
    prefetch = SwapAdamW.prefetch
    # A graph task id other than -1: the call runs inside autograd's backward.
    monkeypatch.setattr(
        SwapAdamW, "prefetch", lambda self: calls.append(torch._C._current_graph_task_id()) or prefetch(self)
    )
    cfg = resolve_config(
        {
            "model": dict(num_layers=2, hidden_size=64, num_attention_heads=4),
            "swap_optimizer": True,
            "data": dict(seq_len=32, micro_num=2, total_steps=3),
            "ckpt": dict(enable_save_ckpt=False),
            "monitor": dict(progress_bar="off"),
        }
    )
    accelerator = Accelerator("cpu")
    trainer = build_trainer(cfg, RunContext(rank=0, local_rank=0, world_size=1, accelerator=accelerator), tmp_path)
    trainer.train()
    trainer.close()
    assert len(calls) == 3 and all(task != -1 for task in calls), calls


@pytest.mark.parametrize(
    "optimizer",
    [
        dict(swap_optimizer=True, use_pinned_optimizer_offload=True),
        dict(hybrid_optimizer=dict(enable=True, offload_fraction=0.5)),
    ],
)
def test_no_host_allocation_after_the_first_step(tmp_path, monkeypatch, optimizer):
    """Every long-lived host buffer (activation pool, selective offload, optimizer slabs) exists after step 1."""
    from internlm_offload.builder import build_trainer
    from internlm_offload.engine.runtime import RunContext

    cfg = resolve_config(
        {
            "model": dict(num_layers=4, hidden_size=64, num_attention_heads=4, checkpoint=0.75),
            "cpu_offloading": dict(enable=True, num_layers=2),
            "selective_checkpoint": True,
            "selective_checkpoint_offload": True,
            **optimizer,
            "data": dict(seq_len=32, micro_num=2, total_steps=4),
            "ckpt": dict(enable_save_ckpt=False),
            "monitor": dict(progress_bar="off"),
        }
    )
    accelerator = Accelerator("cpu")
    trainer = build_trainer(cfg, RunContext(rank=0, local_rank=0, world_size=1, accelerator=accelerator), tmp_path)
    steps_done, allocations = [0], []
    optimizer_step = trainer.optimizer.step

    @functools.wraps(optimizer_step)  # keeps the LR scheduler's mark on it (else torch warns)
    def counted_step(*args):
        optimizer_step(*args)
        steps_done[0] += 1

    monkeypatch.setattr(trainer.optimizer, "step", counted_step)
    host_empty = Accelerator.host_empty
    monkeypatch.setattr(
        Accelerator, "host_empty", lambda self, *a, **k: allocations.append(steps_done[0]) or host_empty(self, *a, **k)
    )
    trainer.train()
    trainer.close()
    assert steps_done[0] == 4 and allocations and set(allocations) == {0}, allocations
