"""Happens-before checking for the cpu emulation: side-stream work must be ordered after the compute work
that last touched its memory.

On a device the compute stream runs behind the host. A copy on a side stream that reads an activation,
or writes memory the compute stream used a moment ago, is correct only if the copy stream first waited
on an event the compute stream recorded after that work. On cpu the compute stream is the calling
thread, whose work is finished by the time the host moves on, so a missing wait corrupts nothing there.
This ledger makes it fail anyway, deterministically:

- a `TorchDispatchMode` on the calling thread numbers every compute op that touches data (host order)
  and remembers, per storage, the last op that read or wrote it (allocations and views touch nothing);
- an event recorded on the compute stream carries the number of the last op before it; one recorded on
  a side stream carries what that stream had waited for (so waits chain across streams);
- each side stream knows the latest compute op it has waited for, as of each submission;
- submitting a task whose memory the compute stream touched after that raises `OrderingError`.

Use: `with accelerator.check_ordering(): ...` (cpu only), in tests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Ops that allocate or re-describe memory without reading or writing its bytes.
_NO_DATA_ACCESS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "set_",
                             "resize_", "detach", "lift_fresh", "alias", "_to_copy_meta"})  # fmt: skip


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
