"""The accelerator layer: the only package that touches `torch.cuda` / `torch.npu`.

- `accelerator`: `Accelerator` (devices, streams, events, memory readings, host allocation) and its
  cuda/npu backend;
- `streams`: the stream and event interface, `finish_and_close`, `CopyTimer`;
- `cpu_streams`, `cpu_checks`, `cpu_memory`: the cpu backend, which emulates side streams with worker
  threads, fails on a missing wait, and reads "device memory" from the kernel;
- `host_buffers`: host memory, a fixed-layout slab (`HostArena`) and a recycling pool (`HostPool`).

Import from here; the modules behind it are free to move.
"""

from internlm_offload.device.accelerator import BACKENDS, Accelerator, get_accelerator, is_available
from internlm_offload.device.cpu_checks import OrderingError
from internlm_offload.device.host_buffers import HostArena, HostPool, PendingCopy, aligned_offsets, aligned_within
from internlm_offload.device.streams import CopyTimer, Event, Stream, StreamError, finish_and_close, storage_key

__all__ = [
    "BACKENDS",
    "Accelerator",
    "CopyTimer",
    "Event",
    "HostArena",
    "HostPool",
    "OrderingError",
    "PendingCopy",
    "Stream",
    "StreamError",
    "aligned_offsets",
    "aligned_within",
    "finish_and_close",
    "get_accelerator",
    "is_available",
    "storage_key",
]
