"""SwapAdamW: AdamW whose states live on the host between steps and visit the device inside `step()`.

What it may touch: its own `state` (host tensors between steps), the params and grads it is given
(updated in place on the device, as AdamW does), and the accelerator layer for streams and host
memory. It never reads a config.

Schedule of one `step()` (device picture; the cpu backend runs the same schedule on worker threads):
- the copy-in stream first waits for the compute stream, so no H2D copy lands in memory that backward
  is still using, and no state is read before backward finished;
- parameters are taken in order; the states of the next ones are copied in (H2D) while the current one
  is stepped, and the states of stepped ones are copied out (D2H) behind it;
- the device holds at most `budget = ceil(total state bytes / swap_optimizer_times)` bytes of state at
  a time (at least one parameter's, if a single one is larger): a device buffer is freed only after the
  compute stream waited for its copy-out, and the copy-in of the next parameter is admitted only when
  the budget allows it.
The update itself is torch's own AdamW kernel (`torch.optim.adam.adam` with the group's flags and
`decoupled_weight_decay=True`), one parameter at a time, so params and states are bitwise those of
`torch.optim.AdamW` with the same arguments.

With `swap_params=True` the parameters themselves live on the host too (fp32 master weights of a
low-precision model, as ZeRO-Offload keeps them): each parameter then carries `main_grad`, its
gradient on the device, and may carry `model_param`, the device tensor (e.g. the bf16 weight the model
computes with) that receives the updated value in its own dtype. The parameter is swapped in and out
with its states, so between steps the device holds neither masters nor states.

Memory saved vs time paid: the device holds `1 / swap_optimizer_times` of the optimizer states (8 bytes
per fp32 parameter, 12 with amsgrad) instead of all of them; each step moves every state twice over the
host link. More chunks: less device memory, smaller copies that overlap less well.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.adam import adam
from torch.optim.optimizer import _get_scalar_dtype

from internlm_offload.device import Accelerator, Event, finish_and_close, get_accelerator
from internlm_offload.log import get_logger
from internlm_offload.optim.adamw import fused_supported, param_groups
from internlm_offload.optim.dtensor import laid_out_like, local_nbytes, local_shard
from internlm_offload.optim.host_arena import HostArena
from internlm_offload.registry import OPTIMIZERS

logger = get_logger(__name__)

SWAPPED_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
PARAM = "param"  # key of a host-resident parameter's device copy while it is staged


@dataclass
class _Staged:
    """One parameter's states on the device for the duration of its update."""

    param: torch.Tensor
    grad: torch.Tensor
    group: dict[str, Any]
    device_states: dict[str, torch.Tensor]
    nbytes: int
    copied_in: Event | None = None
    copied_out: Event | None = None


class SwapAdamW(torch.optim.AdamW):
    """Drop-in `torch.optim.AdamW` with host-resident states; see the module docstring.

    Extra args (InternEvo's key names): `swap_optimizer_times` (chunks the step's device memory is
    divided into), `pin_memory` (None: pinned where the device supports it),
    `use_pinned_optimizer_offload` (all states in one coalesced host buffer), `swap_params` (the params are host tensors with a device `main_grad`; see the
    module docstring), `accelerator` (default: detected).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        swap_optimizer_times: int = 16,
        pin_memory: bool | None = None,
        use_pinned_optimizer_offload: bool = False,
        swap_params: bool = False,
        accelerator: Accelerator | None = None,
    ) -> None:
        if swap_optimizer_times < 1:
            raise ValueError(f"swap_optimizer_times={swap_optimizer_times} must be >= 1")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, foreach=foreach, fused=fused)  # fmt: skip
        self.swap_optimizer_times = swap_optimizer_times
        self.accelerator = accelerator or get_accelerator("auto")
        self.pin_memory = self.accelerator.supports_pinned_memory if pin_memory is None else pin_memory
        self.use_pinned_optimizer_offload = use_pinned_optimizer_offload
        self.swap_params = swap_params
        self._arena: HostArena | None = None
        self._arena_slots: dict[tuple[int, str], int] = {}
        self._h2d = self.accelerator.stream()
        self._d2h = self.accelerator.stream()
        self._device_state_bytes = 0
        self._peak_device_state_bytes = 0

    # ------------------------------------------------------------------ host state

    def _swaps_step(self, group: dict[str, Any]) -> bool:
        # AdamW keeps `step` on the param's device only for fused/capturable kernels; else on the host.
        return bool(group["fused"] or group["capturable"])

    def _host_buffer(self, param: torch.Tensor, key: str, *, zero: bool) -> torch.Tensor:
        """Host storage for one state tensor of `param` (an arena view or its own buffer)."""
        local = local_shard(param)
        if self._arena is not None and (id(param), key) in self._arena_slots:
            host = self._arena.view(self._arena_slots[id(param), key])
        else:
            host = self.accelerator.host_empty(local.shape, local.dtype, pinned=self.pin_memory)
        return laid_out_like(host.zero_() if zero else host, param)

    def _init_host_state(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        """AdamW's lazy state init, with the tensors on the host."""
        state = self.state[param]
        if self._swaps_step(group):
            state["step"] = self.accelerator.host_empty((), _get_scalar_dtype(is_fused=group["fused"]),
                                                        pinned=self.pin_memory).zero_()  # fmt: skip
        else:
            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
        for key in SWAPPED_KEYS[: 3 if group["amsgrad"] else 2]:
            state[key] = self._host_buffer(param, key, zero=True)

    def _maybe_build_arena(self) -> None:
        if not self.use_pinned_optimizer_offload or self._arena is not None:
            return
        specs, slots = [], {}
        for group in self.param_groups:
            keys = SWAPPED_KEYS[: 3 if group["amsgrad"] else 2]
            for p in group["params"]:
                if p.requires_grad:
                    for key in keys:
                        slots[id(p), key] = len(specs)
                        specs.append((local_shard(p).shape, local_shard(p).dtype))
        self._arena = HostArena(self.accelerator, specs, pinned=self.pin_memory)
        self._arena_slots = slots
        logger.info("Optimizer host arena: %d states in one %.1f MB buffer", len(specs), self._arena.nbytes / 2**20)

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._maybe_build_arena()
        work = self._params_to_step()
        total = sum(self._state_bytes(p, g) for p, g in work)
        budget = max(1, math.ceil(total / self.swap_optimizer_times))
        compute = self.accelerator.current_stream()
        self._h2d.wait_stream(compute)  # backward has finished with the grads and the memory
        self._peak_device_state_bytes = 0
        staged: deque[_Staged] = deque()
        copying_out: deque[_Staged] = deque()
        upcoming = deque(work)
        for _ in range(len(work)):
            self._admit(upcoming, staged, copying_out, budget)
            current = staged.popleft()
            current.copied_in.wait()  # compute waits for this parameter's states
            self._update(current)
            self._copy_out(current)
            copying_out.append(current)
        while copying_out:
            self._release(copying_out.popleft())
        assert self._device_state_bytes == 0
        return loss

    def _params_to_step(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        work = []
        for group in self.param_groups:
            for p in group["params"]:
                grad = self._grad(p)
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("SwapAdamW does not support sparse gradients")
                if not self.state[p]:
                    self._init_host_state(p, group)
                work.append((p, group))
        return work

    def _grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient to apply: `main_grad` (on the device) for a host-resident parameter; its `.grad`
        when DCP's state init steps with zero grads set on the params."""
        main_grad = getattr(param, "main_grad", None) if self.swap_params else None
        return param.grad if main_grad is None else main_grad

    def _state_bytes(self, param: torch.Tensor, group: dict[str, Any]) -> int:
        state = self.state[param]
        keys = [k for k in SWAPPED_KEYS if k in state] + (["step"] if self._swaps_step(group) else [])
        return sum(local_nbytes(state[k]) for k in keys) + (local_nbytes(param) if self.swap_params else 0)

    def _admit(self, upcoming: deque, staged: deque, copying_out: deque, budget: int) -> None:
        """Start copy-ins while the device budget allows; free finished copy-outs to make room."""
        while upcoming:
            param, group = upcoming[0]
            need = self._state_bytes(param, group)
            fits = self._device_state_bytes + need <= budget
            if fits or self._device_state_bytes == 0:
                staged.append(self._copy_in(param, group, need))
                upcoming.popleft()
            elif copying_out:
                self._release(copying_out.popleft())
            elif staged:
                return  # the staged ones must be stepped first
            else:
                raise AssertionError("device state accounting out of sync")

    def _copy_in(self, param: torch.Tensor, group: dict[str, Any], nbytes: int) -> _Staged:
        state = self.state[param]
        keys = [k for k in SWAPPED_KEYS if k in state] + (["step"] if self._swaps_step(group) else [])
        grad = self._grad(param)
        device = local_shard(grad).device
        # Allocated on the compute stream: the allocator orders any reuse after this point.
        device_states = {k: laid_out_like(torch.empty_like(local_shard(state[k]), device=device), state[k])
                         if k != "step" else torch.empty_like(state[k], device=device) for k in keys}  # fmt: skip
        sources = {k: state[k] for k in keys}
        if self.swap_params:
            device_states[PARAM], sources[PARAM] = torch.empty_like(param, device=device), param
        # The new buffers may reuse memory a param stepped earlier in this step just released (after the
        # compute stream waited for its copy-out): the copy-in must not start before that point.
        self._h2d.wait_stream(self.accelerator.current_stream())
        for key, dst in device_states.items():
            self.accelerator.copy_async(local_shard(dst), local_shard(sources[key]), self._h2d)
        self._device_state_bytes += nbytes
        self._peak_device_state_bytes = max(self._peak_device_state_bytes, self._device_state_bytes)
        return _Staged(param, grad, group, device_states, nbytes, copied_in=self._h2d.record_event())

    def _update(self, staged: _Staged) -> None:
        """torch's AdamW kernel on one parameter, with the group's flags."""
        p, group, states = staged.param, staged.group, staged.device_states
        host = self.state[p]
        beta1, beta2 = group["betas"]
        target = states[PARAM] if self.swap_params else p
        adam(
            [target], [staged.grad], [states["exp_avg"]], [states["exp_avg_sq"]],
            [states["max_exp_avg_sq"]] if group["amsgrad"] else [],
            [states["step"] if "step" in states else host["step"]],
            amsgrad=group["amsgrad"], has_complex=torch.is_complex(p), beta1=beta1, beta2=beta2,
            lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
            foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
            fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
            found_inf=getattr(self, "found_inf", None), decoupled_weight_decay=group["decoupled_weight_decay"],
        )  # fmt: skip
        model_param = getattr(p, "model_param", None) if self.swap_params else None
        if model_param is not None:
            model_param.copy_(target)  # rounds into the model's dtype, on the compute stream

    def _copy_out(self, staged: _Staged) -> None:
        self._d2h.wait_stream(self.accelerator.current_stream())  # the update is done
        host = self.state[staged.param]
        for key, src in staged.device_states.items():
            dst = staged.param.detach() if key == PARAM else host[key]  # written on a copy thread
            self.accelerator.copy_async(local_shard(dst), local_shard(src), self._d2h)
        staged.copied_out = self._d2h.record_event()

    def _release(self, staged: _Staged) -> None:
        """Free a parameter's device states once their copy-out finished."""
        staged.copied_out.wait()
        staged.device_states.clear()
        self._device_state_bytes -= staged.nbytes

    # ------------------------------------------------------------------ state dict and memory

    def state_dict(self) -> dict[str, Any]:
        self.finish_copies()
        return super().state_dict()

    def close(self) -> None:
        """Finish the copies and stop the copy streams (cpu: their worker threads); no step afterwards."""
        finish_and_close(self._h2d, self._d2h)

    def finish_copies(self) -> None:
        """`step()` returns with its last copy-outs only ordered on the device; readers of the host
        states' values (state_dict, load_state_dict, checkpoints) wait for them here."""
        self._d2h.synchronize()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load AdamW's layout (ours or a plain AdamW's) and move every state into host buffers."""
        self.finish_copies()
        super().load_state_dict(state_dict)
        self._maybe_build_arena()
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                for key in SWAPPED_KEYS:
                    if key in state:
                        host = self._host_buffer(p, key, zero=False)  # may alias state[key]: no zeroing
                        local_shard(host).copy_(local_shard(state[key]))
                        state[key] = host
                if self._swaps_step(group):
                    host_step = self.accelerator.host_empty((), state["step"].dtype, pinned=self.pin_memory)
                    state["step"] = host_step.copy_(state["step"])

    def memory_stats(self) -> dict[str, int]:
        """Byte counts (sizes, not values): no wait for a write-back still running; metrics read them every step."""
        host = sum(local_nbytes(t) for s in self.state.values() for t in s.values() if isinstance(t, torch.Tensor))
        stats = {
            "device_state_bytes": self._device_state_bytes,
            "peak_device_state_bytes": self._peak_device_state_bytes,
            "host_state_bytes": host,
        }
        if self.swap_params:
            stats["host_param_bytes"] = sum(local_nbytes(p) for g in self.param_groups for p in g["params"])
        return stats

    def offload_optimizer_states(self) -> bool:
        """States already live on the host between steps: nothing to move. Returns False (no-op)."""
        return False

    def reload_optimizer_states(self) -> bool:
        """States come to the device only inside `step()`. Returns False (no-op)."""
        return False


@OPTIMIZERS.register_module(name="swap_adamw")
def build_swap_adamw(
    model: torch.nn.Module,
    *,
    accelerator: Accelerator,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    fused: bool | None = None,
    swap_optimizer_times: int = 16,
    use_pinned_optimizer_offload: bool = False,
    swap_params: bool = False,
) -> SwapAdamW:
    """SwapAdamW over the model with the same groups (and fused default) as the baseline AdamW."""
    if fused is None:
        fused = fused_supported(accelerator.name)
    return SwapAdamW(
        param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, fused=fused,
        swap_optimizer_times=swap_optimizer_times, use_pinned_optimizer_offload=use_pinned_optimizer_offload, swap_params=swap_params,
        accelerator=accelerator,
    )  # fmt: skip
