"""The baseline optimizer: torch's AdamW with decay on matrices only (and each group's update rule); helpers the
offloading optimizers share."""

import fnmatch
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

import torch
import torch.nn as nn

from internlm_offload.optim.dtensor import is_dtensor
from internlm_offload.optim.interface import OffloadOptimizer
from internlm_offload.optim.muon_rule import ROW_SPLITS_KEY
from internlm_offload.optim.rules import RULE_KEY

T = TypeVar("T")


class AdamW(OffloadOptimizer, torch.optim.AdamW):
    """`torch.optim.AdamW` with the run's optimizer interface (all no-ops): same steps, same state dicts."""


def param_groups(
    model: nn.Module,
    weight_decay: float,
    rule_patterns: Sequence[tuple[str, str]] = (),
    default_rule: str = "adamw",
    *,
    fallback: Callable[[str, nn.Parameter], str] | None = None,
    row_splits: Mapping[str, tuple[int, ...]] | None = None,
) -> list[dict]:
    """Matrices (embeddings, linears) decay; vectors (norm weights, biases) do not. Each of the two is one group
    per DTensor mesh (first seen first): torch's fused and foreach kernels take no mix of meshes, or of DTensors
    and plain tensors (expert parallel's expert shards beside DDP's plain weights). And one group per update rule:
    a param takes the rule of the first `(pattern, rule name)` whose fnmatch pattern matches its name, else
    `fallback(name, param)` (default: `default_rule`); a group of another rule than `default_rule` names it
    (`RULE_KEY`), so groups without patterns stay as they were. And one group per `row_splits` of a param (by
    name; Muon's row blocks), carried as the group's `ROW_SPLITS_KEY`."""
    row_splits = row_splits or {}
    by_key: dict[tuple[bool, Hashable, str, tuple[int, ...]], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            mesh = param.device_mesh if is_dtensor(param) else None
            rule = next((r for pattern, r in rule_patterns if fnmatch.fnmatchcase(name, pattern)), None)
            rule = rule or (fallback(name, param) if fallback else default_rule)
            splits = tuple(row_splits.get(name, ()))
            by_key.setdefault((param.ndim >= 2, mesh, rule, splits), []).append(param)
    return [
        {"params": params, "weight_decay": weight_decay if decays else 0.0}
        | ({} if rule == default_rule else {RULE_KEY: rule})
        | ({ROW_SPLITS_KEY: splits} if splits else {})
        for decay in (True, False)
        for (decays, _, rule, splits), params in by_key.items()
        if decays == decay
    ]


def fused_supported(device_type: str) -> bool:
    # torch ships fused AdamW kernels for these; on cpu it is ~17x faster than the for-loop path.
    return device_type in ("cpu", "cuda", "mps", "xpu")


def consecutive_runs(
    items: Sequence[T], *, group_of: Callable[[T], Hashable], size_of: Callable[[T], float], target: float
) -> list[list[T]]:
    """`items` in order, cut into runs of one group each, up to `target` in size (an item larger than
    `target` makes a run alone): the swap optimizer's chunks, the hybrid optimizer's CPU-step pieces."""
    runs: list[list[T]] = []
    run_group: Hashable = None
    run_size = 0.0
    for item in items:
        group, size = group_of(item), size_of(item)
        if not runs or group != run_group or (run_size > 0 and run_size + size > target):
            runs.append([])
            run_group, run_size = group, 0.0
        runs[-1].append(item)
        run_size += size
    return runs
