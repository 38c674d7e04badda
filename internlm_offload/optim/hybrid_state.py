"""The hybrid optimizer's states as one AdamW's: the live `state` view and where a loaded state value goes.

Every state tensor lives once, in the sub-optimizer that steps its param (a CPU piece or the device
side); `StateView` presents them keyed by the hybrid optimizer's params, and the helpers place values
the way each sub-optimizer expects them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from internlm_offload.optim.dtensor import is_dtensor, laid_out_like, local_nbytes, local_shard

# Group keys that select a kernel or name params rather than set a hyper-parameter: each sub-optimizer
# keeps its own (the CPU and device kernels may differ), so they are never propagated.
_NOT_PROPAGATED = frozenset({"params", "param_names", "foreach", "fused", "capturable", "differentiable"})

Route = dict[int, tuple[Optimizer, torch.Tensor]]  # id(param) -> (sub-optimizer, the tensor it steps for it)


class StateView(Mapping):
    """`optimizer.state` of a HybridDeviceOptimizer: each param's live state dict inside its sub-optimizer."""

    def __init__(self, route: Route, params: Callable[[], Iterable[torch.Tensor]]) -> None:
        self._route = route
        self._params = params  # the owner's params, in param-group order, read afresh each time

    def live(self, param: torch.Tensor, create: bool = True) -> dict[str, Any] | None:
        """The param's state dict in its sub-optimizer (created empty when missing, unless `create` is False)."""
        route = self._route.get(id(param))
        if route is None:
            raise KeyError("not a param of this optimizer")
        optimizer, key = route
        return optimizer.state[key] if create else optimizer.state.get(key)

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.live(param)
        assert state is not None
        return state

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for p in self._params() if self.live(p, create=False))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, param: object) -> bool:
        return isinstance(param, torch.Tensor) and id(param) in self._route and bool(self.live(param, create=False))


def is_shard_state(value: Any, key: torch.Tensor) -> bool:
    """A per-element state of a host shard (exp_avg, ...), not a scalar like `step`."""
    return torch.is_tensor(value) and not is_dtensor(value) and value.dim() > 0 and value.shape == key.shape


def hyper_params(group: dict[str, Any]) -> dict[str, Any]:
    """A group's hyper-parameters, the keys a sub-optimizer takes from the hybrid optimizer's group."""
    return {k: v for k, v in group.items() if k not in _NOT_PROPAGATED}


def group_of(optimizer: Optimizer, key: torch.Tensor) -> dict[str, Any]:
    return next(g for g in optimizer.param_groups if any(p is key for p in g["params"]))


def placed(value: torch.Tensor, key: torch.Tensor, name: str, group: dict[str, Any]) -> torch.Tensor:
    """A copy of a state value where `group`'s optimizer keeps it (torch's rule, as in `load_state_dict`)."""
    if name == "step":
        value = local_shard(value)  # a scalar: every rank holds the same one
        # Fused and capturable kernels keep `step` on the param's device; the others on the host.
        if group.get("fused") or group.get("capturable"):
            return value.to(device=key.device, dtype=torch.float32, copy=True)
        return value.to(device="cpu", copy=True)
    dtype = key.dtype if key.is_floating_point() else value.dtype
    if is_dtensor(value):  # a device-side DTensor key (reload_optimizer_states, a missing state)
        return laid_out_like(local_shard(value).to(device=local_shard(key).device, dtype=dtype, copy=True), value)
    return value.to(device=key.device, dtype=dtype, copy=True)


def state_bytes(optimizer: Optimizer) -> int:
    return sum(local_nbytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))
