"""The optimizer steps of a run: AdamW or its offloading variants over the masters, their host and disk checks,
the learning-rate schedule and gradient offload's hooks."""

import os
import shutil
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.nn as nn

from internlm_offload.config import ConfigError, RunConfig
from internlm_offload.config.optimizer import uses_muon
from internlm_offload.config.sizes import human_bytes
from internlm_offload.device import Accelerator
from internlm_offload.device.disk_buffers import DiskSpaceError
from internlm_offload.engine.expert_parallel import expert_grad_reduction
from internlm_offload.engine.precision import MasterWeights
from internlm_offload.engine.runtime import RunContext, env_local_world_size, stage_data_mesh
from internlm_offload.model.hooks import HasTensorPlan, SplitsMuonRows
from internlm_offload.optim import build_lr_scheduler, param_groups
from internlm_offload.optim.adamw import fused_supported
from internlm_offload.optim.adamw_rule import ADAMW
from internlm_offload.optim.grad_offload import GradOffload
from internlm_offload.optim.hybrid import HybridDeviceOptimizer
from internlm_offload.optim.hybrid_host import offload_mask
from internlm_offload.optim.interface import OffloadOptimizer
from internlm_offload.optim.memory import (
    HYBRID_MASTER_AND_GRAD_BYTES,
    HostMemoryError,
    check_host_memory,
    groups_state_bytes,
)
from internlm_offload.optim.muon_rule import MUON
from internlm_offload.optim.records import Masters
from internlm_offload.optim.rule_optimizer import optimizer_for_groups
from internlm_offload.optim.rules import RULE_KEY, UpdateRule
from internlm_offload.optim.swap import SwapAdamW

# The update rules a config can name (`optimizer.rules`; config/optimizer.py lists the same names), by name.
RULES: Mapping[str, UpdateRule] = MappingProxyType({ADAMW.name: ADAMW, MUON.name: MUON})
HEAD_NAMES = ("output", "lm_head")  # a head module's name where the model states no plan (transformers', a stage)


def hybrid_cpu_mask(cfg: RunConfig, model: nn.Module) -> list[bool]:
    """Which params, in the optimizer's order (`param_groups`), the hybrid optimizer steps on the CPU (none
    without it). Placed once, before the masters exist: their CPU share lives in host memory."""
    fraction = cfg.hybrid_optimizer.offload_fraction if cfg.hybrid_optimizer.enable else 0.0
    return offload_mask(_optimizer_order(cfg, model), fraction)


def host_master_names(cfg: RunConfig, model: nn.Module, cpu_mask: list[bool]) -> set[str] | None:
    """Names of the fp32 masters kept in host memory: all (None) for the swap optimizer, the hybrid one's CPU
    share (`cpu_mask`) otherwise (none without it)."""
    if cfg.swap_optimizer:
        return None
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)] for p, on_cpu in zip(_optimizer_order(cfg, model), cpu_mask, strict=True) if on_cpu}


def _optimizer_order(cfg: RunConfig, model: nn.Module) -> list[nn.Parameter]:
    return [p for group in run_param_groups(cfg, model) for p in group["params"]]


def run_param_groups(cfg: RunConfig, model: nn.Module) -> list[dict[str, Any]]:
    """The optimizer's param groups: decay on matrices only, each parameter's update rule by `optimizer.rules`, then
    by `optimizer.type` (`muon`: XTuner's split, `muon_split`); Muon's groups carry its hyper-parameters and the
    model's row blocks."""
    optimizer = cfg.optimizer
    groups = param_groups(
        model,
        cfg.adam.weight_decay,
        optimizer.rules,
        default_rule=ADAMW.name,
        fallback=muon_split(model) if optimizer.type == MUON.name else None,
        row_splits=muon_row_splits(model) if uses_muon(optimizer) else None,
    )
    names = {id(p): name for name, p in model.named_parameters()}
    for group in groups:
        if group.get(RULE_KEY) == MUON.name:
            _check_muon_params(group["params"], names)
            group.update(muon_hyperparameters(cfg))
    return groups


def muon_hyperparameters(cfg: RunConfig) -> dict[str, Any]:
    """A Muon group's keys: `optimizer.muon`'s, its lr and weight decay the run's unless given."""
    muon = cfg.optimizer.muon
    return {
        "lr": cfg.adam.lr if muon.lr is None else muon.lr,
        "weight_decay": cfg.adam.weight_decay if muon.weight_decay is None else muon.weight_decay,
        "momentum": muon.momentum,
        "nesterov": muon.nesterov,
        "ns_coefficients": muon.ns_coefficients,
        "eps": muon.eps,
        "ns_steps": muon.ns_steps,
        "adjust_lr_fn": muon.adjust_lr_fn,
        "ns_dtype": muon.ns_dtype,
    }


def muon_split(model: nn.Module) -> Callable[[str, nn.Parameter], str]:
    """XTuner's MuonConfig split: a matrix (ndim >= 2, not [1, n] or [n, 1]; an expert stack [E, out, in]) steps with
    Muon unless it is the embedding or the LM head; everything else (norms, biases, embedding, head) with AdamW."""
    outside = _embedding_and_head(model)

    def rule(name: str, param: nn.Parameter) -> str:
        matrix = param.ndim in (2, 3) and param.numel() not in param.shape
        excluded = any(name == path or name.startswith(path + ".") for path in outside)
        return MUON.name if matrix and not excluded else ADAMW.name

    return rule


def _embedding_and_head(model: nn.Module) -> set[str]:
    """Module paths of the embedding and the LM head: the plan's, every `nn.Embedding`, and modules named as heads."""
    paths = set()
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        if isinstance(module, HasTensorPlan):
            plan = module.tensor_plan()
            paths |= {prefix + plan.embedding, prefix + plan.head}
        if isinstance(module, nn.Embedding) or path.rsplit(".", 1)[-1] in HEAD_NAMES:
            paths.add(path)
    return paths


def muon_row_splits(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Parameter name -> the row blocks Muon orthogonalises apart, as the model's modules declare them."""
    splits = {}
    for path, module in model.named_modules():
        if isinstance(module, SplitsMuonRows):
            prefix = f"{path}." if path else ""
            splits |= {prefix + name: rows for name, rows in module.muon_row_splits().items()}
    return splits


def _check_muon_params(params: list[nn.Parameter], names: dict[int, str]) -> None:
    """`optimizer.rules` may route any parameter to Muon: refuse one it cannot step, in one line."""
    for param in params:
        if param.ndim not in (2, 3):
            raise ConfigError(
                f"optimizer.rules routes {names[id(param)]} (shape {tuple(param.shape)}) to 'muon'; Muon steps "
                "matrices [out, in] and expert stacks [E, out, in]: route it to 'adamw'"
            )


def build_optimizer(
    cfg: RunConfig,
    masters: Masters,
    accelerator: Accelerator,
    *,
    cpu_mask: list[bool] | None = None,
    check_host: bool = True,
) -> OffloadOptimizer:
    """AdamW, or its offloading variants, over the parameters `masters` steps (the fp32 masters where they exist,
    else the model's own through its data-parallel wrapper).

    Every variant gets the same param groups (decay on matrices only) and `fused` choice; the offloading ones the
    masters' records. Host masters (`masters.on_host`) are swapped in with the states (their gradients too with
    `grad_offload`, as host tensors in the records). `cpu_mask`: the hybrid optimizer's placement, when the masters
    were placed by it already (`hybrid_cpu_mask`). `check_host`: refuse states the host memory cannot hold.
    """
    model, host_params = masters.module, masters.on_host
    adam = cfg.adam
    rule = ADAMW  # for the parameters no `optimizer.rules` pattern names another
    on_disk = cfg.nvme_offload.directory is not None
    hyper = {"lr": adam.lr, "betas": (adam.adam_beta1, adam.adam_beta2), "eps": adam.adam_eps}
    groups = run_param_groups(cfg, model)
    if check_host and ((cfg.swap_optimizer and not on_disk) or cfg.hybrid_optimizer.enable):
        check_optimizer_host_memory(cfg, groups)
    if check_host and on_disk:
        fraction = 1.0 if cfg.swap_optimizer else cfg.hybrid_optimizer.offload_fraction
        check_nvme_path(cfg.nvme_offload.directory, int(groups_state_bytes(groups, rule, RULES)[1] * fraction))
    fused = fused_supported(accelerator.name) if adam.fused is None else adam.fused
    if cfg.swap_optimizer:
        return build_swap_optimizer(
            groups,
            fused=fused,
            swap_optimizer_times=cfg.swap_optimizer_times,
            use_pinned_optimizer_offload=cfg.use_pinned_optimizer_offload,
            swap_params=host_params,
            host_grads=cfg.grad_offload,
            nvme_path=cfg.nvme_offload.directory,
            records=masters.records(),
            accelerator=accelerator,
            rule=rule,
            rules=RULES,
            **hyper,
        )
    if cfg.hybrid_optimizer.enable:
        hybrid = cfg.hybrid_optimizer
        # The CPU side keeps its default (the rules' plain optimizers, fused on cpu); the device side gets `fused`.
        return HybridDeviceOptimizer(
            groups,
            offload_fraction=hybrid.offload_fraction,
            gpu_optimizer_cls=optimizer_for_groups(groups, rule, RULES, accelerator.name, fused=fused),
            param_update_in_fp32=hybrid.param_update_in_fp32,
            overlap_cpu_optimizer_d2h_h2d=hybrid.overlap_cpu_optimizer_d2h_h2d,
            accelerator=accelerator,
            cpu_mask=cpu_mask,
            grads_on_host=cfg.grad_offload,
            nvme_path=cfg.nvme_offload.directory,
            records=masters.records(),
            rule=rule,
            rules=RULES,
            **hyper,
        )
    return optimizer_for_groups(groups, rule, RULES, accelerator.name, fused=fused)(groups, **hyper)


def build_swap_optimizer(groups: list[dict[str, Any]], **kwargs: Any) -> SwapAdamW:
    """`SwapAdamW`; with an NVMe path its file is reserved now, and a disk that cannot hold it is a config error."""
    try:
        return SwapAdamW(groups, **kwargs)
    except DiskSpaceError as exc:
        raise ConfigError(f"nvme_offload.path: {exc}") from None


def check_nvme_path(path: str, state_bytes: int) -> None:
    """Refuse before training when the NVMe directory is missing, not writable, or cannot hold this node's
    states (every local rank writes its own files there)."""
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"nvme_offload.path={path!r} is not a writable directory; create it on a local NVMe drive")
    needed = state_bytes * env_local_world_size()
    free = shutil.disk_usage(path).free
    if needed > free:
        raise ConfigError(
            f"nvme_offload.path={path!r} has {human_bytes(free)} free; the offloaded optimizer states of "
            f"{env_local_world_size()} rank(s) on this node need {human_bytes(needed)}"
        )


def check_optimizer_host_memory(cfg: RunConfig, groups: list[dict[str, Any]]) -> None:
    """Refuse before training when the host cannot hold the offloaded optimizer states (each group's rule's)."""
    elements, states = groups_state_bytes(groups, ADAMW, RULES)
    if cfg.swap_optimizer:
        names = "/".join(sorted({g.get(RULE_KEY, ADAMW.name) for g in groups}))
        required, what = states, f"swap_optimizer ({names} states on the host)"
    else:  # the CPU share's masters and grad buffers too, its states by the average bytes per element
        fraction = cfg.hybrid_optimizer.offload_fraction
        required = int((elements * HYBRID_MASTER_AND_GRAD_BYTES + states) * fraction)
        what = "hybrid_optimizer (CPU-stepped params)"
    try:
        check_host_memory(required, what, world_local=env_local_world_size())
    except HostMemoryError as exc:
        raise ConfigError(str(exc)) from None


def build_scheduler(cfg: RunConfig, optimizer: OffloadOptimizer) -> torch.optim.lr_scheduler.LRScheduler:
    schedule = cfg.lr_scheduler
    return build_lr_scheduler(
        optimizer,
        base_lr=cfg.adam.lr,
        warmup_ratio=schedule.warmup_ratio,
        total_steps=schedule.total_steps,
        eta_min=schedule.eta_min,
        decay=schedule.type,
    )


def offload_gradients(cfg: RunConfig, ctx: RunContext, masters: Masters, model: nn.Module) -> GradOffload:
    """Gradient offload's hooks on the model's parameters, feeding the host gradients of what `masters` steps.
    Under DDP it averages them over the ranks itself (the model runs unwrapped: `apply_data_parallel`), expert
    parallel's experts over their own group; FSDP2 reduce-scatters before the hooks see a gradient."""
    reduce_apart = None
    if ctx.expert_mesh is not None:
        names, reduce_experts = expert_grad_reduction(model, ctx.expert_mesh, ctx.expert_grad_divisor)
        reduce_apart = ({id(p) for name, p in model.named_parameters() if name in names}, reduce_experts)
    return GradOffload(
        masters,
        ctx.accelerator,
        bucket_bytes=int(cfg.grad_offload_bucket_mb * 2**20),
        from_zeros=isinstance(masters, MasterWeights),
        reduce=ctx.distributed and cfg.parallel.mode == "ddp",
        reduce_apart=reduce_apart,
        # a pipeline stage's ranks (under isp its tensor ranks too: they hold chunks of the sequences)
        group=stage_data_mesh(ctx, cfg.parallel.tensor.mode == "isp").get_group() if ctx.pipeline_size > 1 else None,
    )
