"""What the trainer, the precision layer and the offload optimizers know of each stepped parameter.

`ParamRecord` is that knowledge, one per trainable parameter; `Masters` is the interface of its owner, the
masters layer (`engine.precision.MasterWeights` / `NoMasters`, or `optim.grad_offload.GradOffload` around
either). The optimizers receive the records from the builder and read them; they never look for attributes
on the parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn as nn

Placement = Literal["device", "host"]


@dataclass(eq=False)
class ParamRecord:
    """One trainable parameter: the tensor backward gives a gradient, the one the optimizer steps, and where
    that step's gradient is.

    Ownership: the masters layer creates the records (`MasterWeights.__init__`, `NoMasters.__init__`), one per
    trainable parameter, and hands them out through `Masters.records()`; the builder passes them to the
    offload optimizers. The fields that change during a step have one writer each:
    - `device_grad`: written by `MasterWeights` when a step's fp32 gradient buffer starts (the first
      micro-batch's `accumulate_grads()`, or `grads()` / `reduce_grads()`) and cleared by its
      `release_grads()`; only for host masters (a host tensor cannot hold a device `.grad`), None otherwise.
    - `host_grad`: written by gradient offload (`GradOffload.grads()`, once every bucket has landed) and
      cleared by its `release_grads()`; None without gradient offload.
    Everything else is fixed at creation. A reader takes `host_grad` first, then `device_grad`, then the
    master's `.grad` (which DCP's optimizer state init sets on the masters themselves).
    """

    model: nn.Parameter  # the compute-dtype parameter backward produces `.grad` on
    master: nn.Parameter  # what the optimizer steps: an fp32 master, or `model` itself without masters
    placement: Placement = "device"  # where `master` lives
    # host masters only: the local shard of `model` (an alias) the optimizer rounds each update into
    model_param: torch.Tensor | None = None
    device_grad: torch.Tensor | None = None  # host masters: this step's fp32 gradient, a view of the flat buffer
    host_grad: torch.Tensor | None = None  # gradient offload: this step's gradient in host memory (a local shard)

    def __post_init__(self) -> None:
        if (self.placement == "host") != (self.model_param is not None):
            raise ValueError(f"a {self.placement} master takes model_param exactly when it lives on the host")

    @property
    def on_host(self) -> bool:
        """Whether the master lives in host memory (its update then goes to `model_param`)."""
        return self.placement == "host"

    def grad(self) -> torch.Tensor | None:
        """The gradient to apply: `host_grad`, else `device_grad`, else the master's `.grad`."""
        if self.host_grad is not None:
            return self.host_grad
        return self.master.grad if self.device_grad is None else self.device_grad


def records_by_master(records: Iterable[ParamRecord] | None) -> dict[int, ParamRecord]:
    """id(master) -> its record: how an optimizer finds the record of a parameter it steps."""
    return {id(record.master): record for record in records or ()}


class Masters(Protocol):
    """What the trainer asks of the parameters it steps: `MasterWeights`, `NoMasters`, or gradient offload
    (`optim.grad_offload.GradOffload`, which wraps either and keeps the gradients in host memory)."""

    module: nn.Module

    @property
    def on_host(self) -> bool: ...
    @property
    def reduce_in_backward(self) -> bool: ...
    def master_params(self) -> Iterator[nn.Parameter]: ...
    def records(self) -> list[ParamRecord]: ...
    def accumulate_grads(self) -> None: ...
    def grads(self) -> list[torch.Tensor]: ...
    def reduce_grads(self, distributed: bool) -> None: ...
    def copy_to_model(self) -> None: ...
    def after_step(self) -> None: ...
    def release_grads(self) -> None: ...
