"""One meta trace per distinct (resolved config, world size, count_work) in a test process (CI time).

The planner's searches (tools/plan, `search_tensor_modes`) trace the same candidates again in every test that
runs one: the search's own `Tracer` keeps its traces for one search only. A meta trace is a function of the
resolved config alone, so a test module that opts in (`pytestmark = pytest.mark.usefixtures("shared_traces")`,
tests/unit/conftest.py) reads every repeated trace from here. Each caller gets its own copy (a StepMemory is
mutable: DDP's buckets are added to one in place). `measure=True` (a real run on cpu tensors) is never cached.
The search's trace counts (`Tracer.traces`) count the calls before they reach `trace_step`: unchanged.
"""

import copy
from typing import Any

from internlm_offload.planner.trace import StepMemory, trace_step

_TRACES: dict[tuple[str, int, bool], StepMemory] = {}  # this process's: shared by every module that opts in


def cached_trace_step(cfg: Any, world_size: int = 1, *, measure: bool = False, count_work: bool = True) -> StepMemory:
    """`trace_step` with the meta traces kept per (config, world size, count_work)."""
    if measure:
        return trace_step(cfg, world_size, measure=True, count_work=count_work)
    key = (cfg.model_dump_json(), world_size, count_work)
    if key not in _TRACES:
        _TRACES[key] = trace_step(cfg, world_size, count_work=count_work)
    return copy.deepcopy(_TRACES[key])
