"""Memoised meta kernels: a traced step's ops answered from their first call's output shapes.

A trace runs the same few hundred op signatures thousands of times (every block, micro-batch and step, and
every candidate of a search), and on the meta device many aten ops are Python code (torch's `_refs` and
`_prims` meta functions), most of a trace's time. `MetaKernelCache` is a dispatch mode, the bottom one
of the trace, that keys each op by its overload and its arguments' metadata (shape, stride, offset, dtype
and every non-tensor argument) and answers a repeated key with fresh empty tensors of the recorded shapes.

Only what a fresh output can stand for is memoised: ops of the aten namespace whose arguments are all
plain meta tensors, whose schema neither mutates an argument nor returns an alias of one, whose output
shapes do not depend on values, and whose outputs each own a storage exactly their size (checked on the
first call). Anything else (views,
in-place ops, collectives, DTensor, outputs sharing a buffer) runs its kernel every time.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from internlm_offload.planner.tracker import tensor_leaves

META = torch.device("meta")
_SKIPPED_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output, torch.Tag.inplace_view)
_UNCACHEABLE = object()  # a key whose op's outputs a fresh tensor cannot stand for

OutputSpec = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]
# What every trace of this process has recorded: an answer depends on the key alone, so a search's candidates
# (and a test session's traces) share it. Bounded: emptied when it grows past `MAX_RECORDED` keys.
_RECORDED: dict[Any, Any] = {}
MAX_RECORDED = 200_000


@functools.cache
def memoisable(func: torch._ops.OpOverload) -> bool:
    """Whether `func`'s schema allows answering it with fresh tensors: aten, no aliasing, no mutation."""
    if func.namespace != "aten" or any(tag in func.tags for tag in _SKIPPED_TAGS):
        return False
    schema = func._schema
    if schema.is_mutable or any(ret.alias_info is not None for ret in schema.returns):
        return False
    return all(arg.alias_info is None for arg in schema.arguments)


def _argument_key(value: Any) -> Any:
    """A hashable stand-in for one argument; raises TypeError for what cannot key a meta op."""
    if isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.device != META:
            raise TypeError("not a plain meta tensor")
        return ("T", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_argument_key(v) for v in value))
    if isinstance(value, dict):
        return ("D", *((k, _argument_key(v)) for k, v in sorted(value.items())))
    hash(value)
    return (type(value), value)


def _output_specs(out: Any, inputs: list[torch.Tensor]) -> tuple[type | None, tuple[OutputSpec, ...]] | None:
    """(`out`'s container type, None for one tensor; each output's spec) when every output is a tensor owning
    its own exact storage (no input's: `_unsafe_view` returns a view its schema does not declare); else None."""
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    if not outputs or not all(type(t) is torch.Tensor and t.device == META for t in outputs):
        return None
    storages = {t.untyped_storage()._cdata for t in outputs}
    if len(storages) != len(outputs) or storages & {t.untyped_storage()._cdata for t in inputs}:
        return None
    for t in outputs:
        if t.storage_offset() != 0 or t.untyped_storage().nbytes() != _exact_nbytes(t):
            return None
    container = type(out) if isinstance(out, (tuple, list)) else None
    return container, tuple((tuple(t.shape), t.stride(), t.dtype) for t in outputs)


def _exact_nbytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()


class MetaKernelCache(TorchDispatchMode):
    """See the module docstring. `hits` and `misses` count the answered and the computed calls."""

    def __init__(self) -> None:
        super().__init__()
        if len(_RECORDED) > MAX_RECORDED:
            _RECORDED.clear()
        self._outputs = _RECORDED
        self.hits = 0
        self.misses = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        key = self._key(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        recorded = self._outputs.get(key)
        if recorded is not None and recorded is not _UNCACHEABLE:
            self.hits += 1
            container, specs = recorded
            outputs = [torch.empty_strided(shape, stride, dtype=dtype, device=META) for shape, stride, dtype in specs]
            return container(outputs) if container else outputs[0]
        out = func(*args, **kwargs)
        if recorded is None:
            self.misses += 1
            inputs = tensor_leaves((args, kwargs))
            self._outputs[key] = _output_specs(out, inputs) or _UNCACHEABLE
        return out

    def _key(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if not (isinstance(func, torch._ops.OpOverload) and memoisable(func)):
            return None
        try:
            return (func, _argument_key(args), _argument_key(kwargs))
        except TypeError:
            return None
