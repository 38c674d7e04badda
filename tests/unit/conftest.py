import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test helpers (op_counter.py)
sys.path.insert(0, str(Path(__file__).parents[1]))  # helpers shared with the e2e tests (chat_fixtures.py)
sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))  # runner.py: multi-process runs forked (fork_server.py)


@pytest.fixture(scope="module")
def shared_traces(request: pytest.FixtureRequest):
    """The module's meta traces read from this process's cache (trace_cache.py): the planner's own seam
    (`compose.trace_step`, which every search and composed trace calls) and the module's `trace_step`."""
    from trace_cache import cached_trace_step

    from internlm_offload.planner import compose

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compose, "trace_step", cached_trace_step)
        if hasattr(request.module, "trace_step"):
            patch.setattr(request.module, "trace_step", cached_trace_step)
        yield
