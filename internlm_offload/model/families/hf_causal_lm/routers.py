"""Forward hooks on a transformers model's routers: the router logits its load-balancing loss is made of, and the
top-k choices of its noaux_tc routers (DeepSeek-V3's sigmoid router with `e_score_correction_bias`, which
transformers never updates; GLM-4.5/4.7/5 and DeepSeek-V3.2 copy it).

The wrapper lends the hooks a sink during its own forward and takes it back after, as the native model lends its
sparse blocks a `stats_sink`: a router recomputed in backward (activation checkpointing) finds none and records
nothing (its choices would count twice, and its logits keep the recomputed graph alive).
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from internlm_offload.model.router import BIAS, ChoiceCounts, global_aux_loss, router_logits_stats


def logits_router_class(hf_model: nn.Module) -> tuple[type[nn.Module], int] | None:
    """The module class whose output transformers records as `router_logits`, and the output's index; None if the
    model declares none. Read from the model's `_can_record_outputs`, transformers' own map of where they come from."""
    recorders: dict[str, Any] = getattr(hf_model, "_can_record_outputs", None) or {}
    recorder = recorders.get("router_logits")
    if isinstance(recorder, type):
        return recorder, 0
    target = getattr(recorder, "target_class", None)
    return None if target is None else (target, getattr(recorder, "index", 0) or 0)


def bias_routers(hf_model: nn.Module) -> list[nn.Module]:
    """The modules that own an `e_score_correction_bias` buffer, in depth order."""
    return [module for module in hf_model.modules() if isinstance(getattr(module, BIAS, None), torch.Tensor)]


def _choices(output: Any) -> torch.Tensor:
    """A noaux_tc router's (T, k) top-k expert ids: its one integer output (transformers returns logits, weights, ids)."""
    outputs = output if isinstance(output, tuple) else (output,)
    ids = [t for t in outputs if isinstance(t, torch.Tensor) and not t.is_floating_point()]
    if len(ids) != 1:
        raise RuntimeError(f"a router with {BIAS} returned {len(ids)} integer tensors; expected its top-k expert ids")
    return ids[0]


class RouterTaps:
    """Hooks on the routers of `hf_model`: with `aux_top_k`, the logits of its softmax top-k routers for the
    load-balancing loss; always, the choices of its bias routers, summed per step in `choices`."""

    def __init__(self, hf_model: nn.Module, aux_top_k: int | None) -> None:
        self.aux_top_k = aux_top_k
        self.aux_routers: list[nn.Module] = []
        self._logits_index = 0
        if aux_top_k is not None:
            found = logits_router_class(hf_model)
            if found is not None:
                cls, self._logits_index = found
                self.aux_routers = [m for m in hf_model.modules() if isinstance(m, cls)]
            if not self.aux_routers:
                raise ValueError(
                    f"{type(hf_model).__name__} has a router_aux_loss_coef but no router whose logits transformers "
                    "records (`_can_record_outputs['router_logits']`); set router_aux_loss_coef=0"
                )
        self.bias_routers = bias_routers(hf_model)
        self.choices = ChoiceCounts(len(self.bias_routers))
        self._logits: list[torch.Tensor] | None = None  # the sink, lent during the wrapper's forward only
        self._counting = False
        for router in self.aux_routers:
            router.register_forward_hook(self._record_logits)
        for index, router in enumerate(self.bias_routers):
            router.register_forward_hook(self._count_hook(index, getattr(router, BIAS).numel()))

    def _record_logits(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._logits is not None:
            logits = output[self._logits_index] if isinstance(output, tuple) else output
            self._logits.append(logits.reshape(-1, logits.shape[-1]))

    def _count_hook(self, index: int, num_experts: int) -> Any:
        def count(module: nn.Module, args: Any, output: Any) -> None:
            if self._counting:
                self.choices.add(index, _choices(output), num_experts)

        return count

    @contextlib.contextmanager
    def tap(self, count: bool = True) -> Iterator[list[torch.Tensor]]:
        """Record during the `with` body (the wrapper's forward): yields the list the router logits go to; `count`:
        the bias routers' choices too (a training forward's; a validation forward must not move the bias)."""
        logits: list[torch.Tensor] = []
        self._logits, self._counting = (logits if self.aux_routers else None), count
        try:
            yield logits
        finally:
            self._logits, self._counting = None, False

    def aux_loss(self, logits: list[torch.Tensor]) -> torch.Tensor:
        """transformers' load-balancing loss (`load_balancing_loss_func` of Mixtral, Qwen-MoE, GPT-OSS) over every
        token of the forward, without its coefficient: E * sum_e (top-k choices of e / rows) * (softmax mass of e /
        rows), pooled over the layers (`global_aux_loss`). Computed here from the recorded logits, not by transformers,
        which reads a 2-D padding mask where packed documents hand the model a 4-D one."""
        assert self.aux_top_k is not None
        stats = [router_logits_stats(layer, self.aux_top_k) for layer in logits]
        return global_aux_loss(stats, logits[0].shape[-1])

    def biases(self) -> list[torch.Tensor]:
        """The bias routers' `e_score_correction_bias` buffers, in depth order (read each time: a cast or a load may
        have replaced the tensors)."""
        return [getattr(router, BIAS) for router in self.bias_routers]
