"""AdamW as an update rule: what every optimizer tier steps unless a param group names another rule."""

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim.adam import adam
from torch.optim.optimizer import Optimizer, _get_scalar_dtype

from internlm_offload.optim.adamw import AdamW
from internlm_offload.optim.rules import Group, StateSpec, UpdateRule

ADAMW_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # AdamW's per-element states, amsgrad's last


class AdamWRule(UpdateRule):
    """torch's AdamW: `exp_avg`, `exp_avg_sq` (+ `max_exp_avg_sq` with amsgrad) and `step`; the step is torch's
    functional `adam` with the group's flags, the call `torch.optim.AdamW.step` makes, so every tier is bitwise it."""

    name = "adamw"
    kernel_ops = ("aten._fused_adamw_.default", "aten._fused_adam_.default")
    update_bytes = 28  # read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq (fp32)

    def state_keys(self, group: Group) -> tuple[str, ...]:
        keys = ADAMW_STATE_KEYS[: 3 if group["amsgrad"] else 2]
        # Fused and capturable kernels read `step` on the param's device; the others on the host.
        return keys + (("step",) if _step_on_device(group) else ())

    def state_specs(self, param: torch.Tensor, group: Group) -> list[StateSpec]:
        step_dtype = _get_scalar_dtype(is_fused=group["fused"])
        return [
            StateSpec(k, torch.Size(()), step_dtype, per_element=False)
            if k == "step"
            else StateSpec(k, param.shape, param.dtype)
            for k in self.state_keys(group)
        ]

    def defaults(self) -> dict[str, Any]:
        return {
            "lr": 1e-3,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            "weight_decay": 1e-2,
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": True,
        }

    def host_states(self, group: Group) -> dict[str, torch.Tensor]:
        return {} if _step_on_device(group) else {"step": torch.tensor(0.0, dtype=_get_scalar_dtype())}

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
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            states["exp_avg"],
            states["exp_avg_sq"],
            states.get("max_exp_avg_sq", []),
            states["step"],
            amsgrad=group["amsgrad"],
            has_complex=has_complex,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            grad_scale=grad_scale,
            found_inf=found_inf,
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )

    def state_bytes(self, dtype: torch.dtype, group: Group) -> int:
        return dtype.itemsize * (3 if group.get("amsgrad") else 2)  # `step` is one scalar per param: not counted

    def optimizer_class(self, device_type: str) -> Callable[..., Optimizer] | None:
        return AdamW


ADAMW = AdamWRule()  # stateless: shared


def _step_on_device(group: Group) -> bool:
    return bool(group["fused"] or group["capturable"])
