"""The accelerator layer: the only package that touches `torch.cuda` / `torch.npu`.

- `accelerator`: `Accelerator` (devices, streams, events, memory readings, host allocation) and its
  cuda/npu backend;
- `streams`: the stream and event interface, `finish_and_close`;
- `copy_lane`: `CopyLane`, the copy recipe every offload path uses (wait, copy, keep alive, event), timed
  by `CopyTimer`;
- `cpu_streams`, `cpu_checks`, `cpu_memory`: the cpu backend, which emulates side streams with worker
  threads, fails on a missing wait, and reads "device memory" from the kernel;
- `layout`: the page size, `round_up`, tensors at aligned offsets of a flat buffer (`aligned_views`);
- `host_alloc`: host allocation per backend (registered pinned memory on cuda, /dev/shm files on cpu);
- `host_buffers`: the layouts over it, a fixed-layout slab (`HostArena`) and a recycling pool (`HostPool`);
- `disk_buffers`: the NVMe tier's mapped files.

Imports among these modules run one way, low to high: `layout`, `streams`, `cpu_checks`, `cpu_memory`,
`disk_buffers`; `host_alloc`; `cpu_streams`; `accelerator`; `host_buffers`, `copy_lane`.

Import from here; the modules behind it are free to move.
"""

from internlm_offload.device.accelerator import BACKENDS, Accelerator, accelerator_for, get_accelerator, is_available
from internlm_offload.device.copy_lane import CopyLane, CopyTimer
from internlm_offload.device.cpu_checks import OrderingError
from internlm_offload.device.host_buffers import HostArena, HostPool, PendingCopy
from internlm_offload.device.layout import PAGE_BYTES, aligned_offsets, aligned_views, aligned_within, round_up, view_at
from internlm_offload.device.streams import Event, Stream, StreamError, finish_and_close, storage_key

__all__ = [
    "BACKENDS",
    "PAGE_BYTES",
    "Accelerator",
    "CopyLane",
    "CopyTimer",
    "Event",
    "HostArena",
    "HostPool",
    "OrderingError",
    "PendingCopy",
    "Stream",
    "StreamError",
    "accelerator_for",
    "aligned_offsets",
    "aligned_views",
    "aligned_within",
    "finish_and_close",
    "get_accelerator",
    "is_available",
    "round_up",
    "storage_key",
    "view_at",
]
