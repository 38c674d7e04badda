"""One training step under `torch.profiler`: a Chrome trace per rank (`monitor.profile_step`).

The trace shows whether the offload copies overlap compute: on cuda the copies are `gpu_memcpy` events on
the side streams beside the `kernel` events of the compute stream (`tools.trace_overlap` measures it);
on cpu the copies run on the side-stream worker threads beside the main thread's operators.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.profiler

from internlm_offload.device.accelerator import Accelerator
from internlm_offload.log import get_logger

logger = get_logger(__name__)


def trace_path(out_dir: Path, step: int, rank: int) -> Path:
    return out_dir / f"step{step}_rank{rank}.json.gz"


@contextmanager
def profiled_step(
    step: int, *, profile_step: int, out_dir: Path, accelerator: Accelerator, rank: int
) -> Iterator[None]:
    """Profile the body when `step == profile_step` (0: never) and write its trace; otherwise run it bare."""
    if profile_step == 0 or step != profile_step:
        yield
        return
    activities = accelerator.profiler_activities()
    with torch.profiler.profile(activities=activities) as profiler:
        yield
        accelerator.synchronize()  # the side streams' last copies belong to this step's trace
    out_dir.mkdir(parents=True, exist_ok=True)
    path = trace_path(out_dir, step, rank)
    profiler.export_chrome_trace(str(path))  # a `.gz` name is written gzipped
    logger.info("profiled step %d: %s (open in chrome://tracing or https://ui.perfetto.dev)", step, path)
