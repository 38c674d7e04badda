"""Muon: `torch.optim.Muon`'s constructor and step over `MuonRule`, for expert stacks and row blocks too."""

from typing import Any

import torch

from internlm_offload.optim.muon_rule import (
    MUON,
    MUON_DEFAULTS,
    NS_DTYPE_DEFAULT,
    NS_DTYPE_KEY,
    ROW_SPLITS_KEY,
    check_hyperparameters,
    check_shape,
    ns_dtype_name,
)
from internlm_offload.optim.rule_optimizer import RuleOptimizer


class Muon(RuleOptimizer):
    """`torch.optim.Muon` (same arguments, defaults, state and state dicts; bitwise its steps on `[out, in]`
    matrices) that also takes stacked experts `[E, out, in]` (each expert orthogonalised alone), groups with
    `row_splits` (each matrix's row blocks orthogonalised apart) and `ns_dtype=torch.float32` (Newton-Schulz in
    fp32 rather than torch's bf16); see optim/muon_rule.py."""

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = MUON_DEFAULTS["lr"],
        weight_decay: float = MUON_DEFAULTS["weight_decay"],
        momentum: float = MUON_DEFAULTS["momentum"],
        nesterov: bool = MUON_DEFAULTS["nesterov"],
        ns_coefficients: tuple[float, float, float] = MUON_DEFAULTS["ns_coefficients"],
        eps: float = MUON_DEFAULTS["eps"],
        ns_steps: int = MUON_DEFAULTS["ns_steps"],
        adjust_lr_fn: str | None = MUON_DEFAULTS["adjust_lr_fn"],
        *,
        ns_dtype: torch.dtype | str = NS_DTYPE_DEFAULT,
    ) -> None:
        check_hyperparameters(lr, weight_decay, momentum, ns_coefficients, ns_steps, adjust_lr_fn)
        # ours: Newton-Schulz in bf16 (torch's) or fp32; only a non-default one joins the groups, so the state dicts
        # stay torch's key for key
        extra = {} if ns_dtype_name(ns_dtype) == NS_DTYPE_DEFAULT else {NS_DTYPE_KEY: ns_dtype_name(ns_dtype)}
        super().__init__(
            params,
            rule=MUON,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            **extra,
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if NS_DTYPE_KEY in group:
            group[NS_DTYPE_KEY] = ns_dtype_name(group[NS_DTYPE_KEY])
        for param in group["params"]:  # torch refuses a non-matrix here too, not at the first step
            check_shape(param.shape, group.get(ROW_SPLITS_KEY))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ours or `torch.optim.Muon`'s; the row blocks stay those of the live groups (a layout of the model,
        not a hyper-parameter: torch's state dicts do not have them), and a state dict without `ns_dtype` (torch's)
        keeps the live groups'."""
        splits = [group.get(ROW_SPLITS_KEY) for group in self.param_groups]
        dtypes = [group.get(NS_DTYPE_KEY) for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, split, dtype in zip(self.param_groups, splits, dtypes, strict=True):
            group.pop(ROW_SPLITS_KEY, None)
            if split is not None:
                group[ROW_SPLITS_KEY] = split
            if dtype is not None:
                group.setdefault(NS_DTYPE_KEY, dtype)
