"""Update rules: what an optimizer keeps per parameter and how it steps, apart from where the tiers keep it.

Every optimizer tier (plain, swap, NVMe, hybrid, gradient offload) decides where states live and when they
move; the rule alone says which states exist, how they start, how one group of parameters is stepped, how
many bytes they take, and whether the step needs whole parameters. A tier hands `step` the tensors it has at
hand (a swapped-in chunk, a host piece, a device group), so a rule never knows which tier runs it.

AdamW is the first rule (`optim.adamw_rule.AdamWRule`). Where a new rule goes: docs/architecture.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import Optimizer

from internlm_offload.optim.dtensor import is_dtensor

Group = Mapping[str, Any]  # a param group: the rule reads its hyper-parameters and kernel flags
# A param group naming its rule (a plain string, so state dicts stay loadable with weights_only); a group without
# it takes its optimizer's default rule.
RULE_KEY = "update_rule"


@dataclass(frozen=True)
class StateSpec:
    """One per-parameter state tensor a tier holds (and moves) beside its parameter."""

    key: str
    shape: torch.Size
    dtype: torch.dtype
    per_element: bool = True  # shaped like the param (a DTensor param's states are laid out like it); else a scalar

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


class UpdateRule(ABC):
    """How parameters are updated from their gradients; stateless, so one instance serves every tier and group."""

    name: str = ""  # how configs and messages call it
    whole_params: bool = False  # the step reads a whole parameter (Muon's matrix), not element by element
    # For the planner's step time: the aten ops of its step, each taking the params it updates first (counted as
    # traced), and the bytes one step reads and writes per fp32 element (its step is memory-bound).
    kernel_ops: tuple[str, ...] = ()
    update_bytes: int = 0

    @abstractmethod
    def state_keys(self, group: Group) -> tuple[str, ...]:
        """The per-parameter states a tier holds beside the parameter, in the order they are laid out."""

    @abstractmethod
    def state_specs(self, param: torch.Tensor, group: Group) -> list[StateSpec]:
        """Shape and dtype of each of `state_keys(group)` for `param` (a plain tensor: a tier's local view)."""

    def defaults(self) -> dict[str, Any]:
        """The group keys its step reads, with their defaults: the tiers fill a group's missing ones."""
        return {}

    def host_states(self, group: Group) -> dict[str, torch.Tensor]:
        """States that stay host tensors whatever the tier (read by the kernel there), freshly initialised."""
        return {}

    @abstractmethod
    def step(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: Mapping[str, list[torch.Tensor]],
        group: Group,
        *,
        has_complex: bool = False,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """Update `params` in place (and their `states`, one list per key, zero at the first step)."""

    @abstractmethod
    def state_bytes(self, dtype: torch.dtype, group: Group) -> int:
        """Bytes of the states held beside the parameter, per parameter element of `dtype`."""

    def optimizer_class(self, device_type: str) -> Callable[..., Optimizer] | None:
        """An optimizer class whose step is this rule (torch's own, whose state dicts load anywhere); None: the
        generic `RuleOptimizer`."""
        return None


def rule_for(group: Group, default: UpdateRule, named: Mapping[str, UpdateRule]) -> UpdateRule:
    """The rule that steps `group`: the one it names (`RULE_KEY`), else `default`."""
    name = group.get(RULE_KEY)
    if name is None or name == default.name:
        return default
    if name not in named:
        known = sorted({default.name, *named})
        raise ValueError(f"a param group names update rule {name!r}; this optimizer has {known}: pass it in rules=")
    return named[name]


def fill_defaults(group: dict[str, Any], rule: UpdateRule) -> None:
    """Give `group` the rule's hyper-parameters it does not set (those it sets stay)."""
    for key, value in rule.defaults().items():
        group.setdefault(key, value)


def refuse_sharded_params(rule: UpdateRule, params: Iterable[torch.Tensor], tier: str) -> None:
    """A rule that steps whole parameters cannot step this rank's shard of one (FSDP2 DTensor): refuse in one line."""
    if rule.whole_params and any(is_dtensor(p) for p in params):
        raise ValueError(
            f"update rule {rule.name!r} steps whole parameters, but {tier} holds shards of DTensor (FSDP2, tensor "
            "parallel) parameters and does not gather them; run it without parameter sharding"
        )


def has_complex(params: Sequence[torch.Tensor]) -> bool:
    return any(torch.is_complex(p) for p in params)
