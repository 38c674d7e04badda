"""The cpu emulation's checks: what a device would get wrong silently fails loudly here.

1. Freed tensors (`check_alive`, run before every side-stream task): a task whose tensor nothing but the
   task still holds raises. On a device the caching allocator could already have handed that memory to
   someone else; the program must keep a reference until the stream's event completed, or
   `record_stream` it.

2. Ordering (`ComputeLedger`, under `Accelerator.check_ordering()`, in tests): side-stream work must be
   ordered after the compute work that last touched its memory. On a device the compute stream runs
   behind the host: a copy on a side stream that reads an activation, or writes memory the compute
   stream used a moment ago, is correct only if the copy stream first waited on an event the compute
   stream recorded after that work. On cpu the compute stream is the calling thread, whose work is
   finished by the time the host moves on, so a missing wait corrupts nothing there. The ledger makes
   it fail anyway, deterministically:
   - a `TorchDispatchMode` on the calling thread numbers every compute op that touches data (host
     order) and remembers, per storage, the last op that read or wrote it (allocations and views
     touch nothing);
   - an event recorded on the compute stream carries the number of the last op before it; one recorded
     on a side stream carries what that stream had waited for (so waits chain across streams);
   - each side stream knows the latest compute op it has waited for, as of each submission;
   - submitting a task whose memory the compute stream touched after that raises `OrderingError`.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Ops that allocate or re-describe memory without reading or writing its bytes.
_NO_DATA_ACCESS = frozenset(
    {
        "empty",
        "empty_strided",
        "empty_like",
        "new_empty",
        "new_empty_strided",
        "set_",
        "resize_",
        "detach",
        "lift_fresh",
        "alias",
        "_to_copy_meta",
    }
)


class OrderingError(RuntimeError):
    """A side-stream task was submitted before its stream waited for the compute work on its memory."""


class ComputeLedger(TorchDispatchMode):
    """Per storage, the number of the last compute op (on the calling thread) that touched it."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch = 0
        self._last_touch: dict[int, tuple[int, str]] = {}
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _NO_DATA_ACCESS:
            with self._lock:
                self.epoch += 1
                for tensor in _cpu_tensors(tree_leaves((args, kwargs, out))):
                    self._last_touch[tensor.untyped_storage().data_ptr()] = (self.epoch, name)
        return out

    def check(self, stream_name: str, waited: int, tensors: Iterable[torch.Tensor]) -> None:
        """Raise if the compute stream touched any of `tensors` after compute op number `waited`."""
        with self._lock:
            for tensor in _cpu_tensors(tensors):
                epoch, op = self._last_touch.get(tensor.untyped_storage().data_ptr(), (0, ""))
                if epoch > waited:
                    raise OrderingError(
                        f"a task on {stream_name} uses a {tuple(tensor.shape)} {tensor.dtype} tensor that the compute "
                        f"stream touched at op #{epoch} (aten.{op}), but the stream last waited for op #{waited}: "
                        "make it wait for the compute stream (wait_stream / wait_event) before submitting"
                    )


def _cpu_tensors(objects: Iterable[Any]) -> Iterable[torch.Tensor]:
    for obj in objects:
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.untyped_storage().nbytes():
            yield obj


def check_alive(stream_name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """Raise if a tensor this task uses is held by nothing but the task: the program freed it.

    On a device the caching allocator could already have handed that memory to someone else (the
    task would read or write a stranger's data): the program must keep a reference until the
    stream's event completed, or `record_stream` it.
    """
    orphan = _orphan(fn, args, kwargs)
    if orphan is not None:
        raise RuntimeError(
            f"a tensor ({tuple(orphan.shape)}, {orphan.dtype}) queued on {stream_name} was freed by the program "
            "before the stream used it; keep a reference until the stream's event completes, or record_stream it"
        )


def _orphan(fn: Callable[..., Any], args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A cpu tensor of the task whose storage nothing outside the task refers to, if any.

    A storage is alive when a tensor object the task does not hold points to it (each tensor object
    is one reference to its storage), or when something besides the task refers to one of the task's
    tensor objects (counted with `sys.getrefcount`, less the task's own references and this function's).
    """
    found = list(task_tensors(getattr(fn, "__self__", None), args, kwargs))
    occurrences = Counter(map(id, found))
    # A view keeps its base alive: the base counts as held by the task (with no reference of the task's own).
    bases = [t._base for t in found if t._base is not None]
    own = {**{id(t): _OWN_BASE_REFS for t in bases}, **{key: n + _OWN_REFS for key, n in occurrences.items()}}
    unique = {id(t): t for t in found + bases if t.device.type == "cpu" and t.untyped_storage().nbytes()}
    del found, bases
    by_storage: dict[int, list[int]] = {}
    for key in unique:
        by_storage.setdefault(unique[key].untyped_storage().data_ptr(), []).append(key)
    for keys in by_storage.values():
        # +1: the storage object `untyped_storage()` makes for the call
        if torch._C._storage_Use_Count(unique[keys[0]].untyped_storage()._cdata) > 1 + len(keys):
            continue
        if any(sys.getrefcount(unique[key]) > own[key] for key in keys):
            continue
        return unique[keys[0]]
    return None


def _own_refs(base: bool) -> int:
    """References `_orphan` holds to a task tensor, or to the base of a task's view (calibrated once: they
    depend on the interpreter and on torch keeping a view's base wrapper alive)."""
    probe = torch.zeros(2)
    task_args = (probe[:1],) if base else (probe,)
    del probe

    def measure() -> int:  # holds it as `_orphan` does: in a dict, then getrefcount's argument
        held = task_args[0]._base if base else task_args[0]
        unique = {id(held): held}
        del held
        return sys.getrefcount(unique[next(iter(unique))])

    return measure() - (0 if base else 1)  # less the task's own reference (`task_args`)


_OWN_REFS, _OWN_BASE_REFS = _own_refs(base=False), _own_refs(base=True)


def task_tensors(*objects: Any) -> Iterator[torch.Tensor]:
    """The tensors among `objects`, one level into tuples, lists and dicts."""
    for obj in objects:
        items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else (obj,)
        for item in items:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list)):
                yield from (t for t in item if isinstance(t, torch.Tensor))
