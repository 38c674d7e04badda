"""RuleOptimizer: a plain optimizer for any update rule, its states beside the params (no offload)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from internlm_offload.optim.interface import OffloadOptimizer, evaluate_closure
from internlm_offload.optim.rules import UpdateRule, fill_defaults, has_complex, rule_for


class RuleOptimizer(OffloadOptimizer, Optimizer):
    """Steps each param group with its rule (`rule`, or the one of `rules` it names), as a torch optimizer would;
    `defaults` are the groups' hyper-parameters, each rule's own defaults (`UpdateRule.defaults`) under them."""

    def __init__(
        self, params: Any, rule: UpdateRule, rules: Mapping[str, UpdateRule] | None = None, **defaults: Any
    ) -> None:
        self.rule = rule
        self.rules = dict(rules or {})
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        fill_defaults(self.param_groups[-1], self._rule(self.param_groups[-1]))

    def _rule(self, group: dict[str, Any]) -> UpdateRule:
        return rule_for(group, self.rule, self.rules)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params)
        return loss

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        for p in params:
            if not self.state[p]:
                self.state[p] = self._initial_state(p, group)
        states = {key: [self.state[p][key] for p in params] for key in self._keys(group)}
        grads = [p.grad for p in params]
        self._rule(group).step(
            params,
            grads,
            states,
            group,
            has_complex=has_complex(params),
            grad_scale=getattr(self, "grad_scale", None),  # set by a grad scaler, as on torch's optimizers
            found_inf=getattr(self, "found_inf", None),
        )

    def _keys(self, group: dict[str, Any]) -> list[str]:
        rule = self._rule(group)
        return [*rule.host_states(group), *rule.state_keys(group)]

    def _initial_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        rule = self._rule(group)
        state = rule.host_states(group)
        for spec in rule.state_specs(param, group):
            if spec.per_element:  # zeros_like keeps a DTensor param's layout
                state[spec.key] = torch.zeros_like(param, dtype=spec.dtype, memory_format=torch.preserve_format)
            else:
                state[spec.key] = torch.zeros(spec.shape, dtype=spec.dtype, device=param.device)
        return state


def optimizer_for_groups(
    groups: Iterable[Mapping[str, Any]],
    default: UpdateRule,
    named: Mapping[str, UpdateRule],
    device_type: str,
    **flags: Any,
) -> Callable[..., Optimizer]:
    """`plain_optimizer` of the one rule `groups` step (`rule_for`), or a `RuleOptimizer` stepping each group with
    its own when they name several (its `flags` then the defaults of every group)."""
    rules = {rule.name: rule for rule in (rule_for(group, default, named) for group in groups)}
    if len(rules) <= 1:
        return plain_optimizer(next(iter(rules.values()), default), device_type, **flags)
    return functools.partial(RuleOptimizer, rule=default, rules=named, **flags)


def plain_optimizer(rule: UpdateRule, device_type: str, **flags: Any) -> Callable[..., Optimizer]:
    """`(param_groups, **hyper-parameters) -> Optimizer` stepping `rule` where the params are: the rule's own
    optimizer class where it has one (with `flags`, e.g. `fused`), else a `RuleOptimizer`."""
    cls = rule.optimizer_class(device_type)
    if cls is not None:
        return functools.partial(cls, **flags)
    return functools.partial(RuleOptimizer, rule=rule)
