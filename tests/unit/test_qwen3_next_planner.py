"""The planner's trace of Gated DeltaNet (model/gated_deltanet.py's `DeltaScan`, model/meta_trace.py): on meta, the
scan over chunks runs its first two chunks forward and backward and counts the rest's matmuls in one stand-in op;
the trace's every figure is the one of the scan run whole (memory, FLOPs, the segments the search composes from), at
two sequences (4 and 8 chunks of 64 a row), two rows a micro-batch (a reset inside the scan) and with half the blocks
recomputed (the tiny Qwen3-Next: 3 DeltaNet blocks and 1 attention block)."""

import pytest

from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.model import meta_trace
from internlm_offload.planner import trace


@pytest.mark.parametrize(("seq_len", "checkpoint"), [(256, 0.0), (512, 0.5)])
def test_the_shortened_trace_gives_every_figure_of_the_whole_scan(monkeypatch, seq_len, checkpoint):
    options = {"data.seq_len": seq_len, "data.micro_num": 1, "data.micro_bsz": 2, "model.checkpoint": checkpoint}
    cfg = resolve_config(load_config_file("configs/qwen3_next_tiny.py", options), world_size=1)
    shortened = trace.trace_step(cfg, 1)
    monkeypatch.setattr(meta_trace, "TRACED_CHUNKS", 1 << 30)
    whole = trace.trace_step(cfg, 1)
    assert shortened.micro_batch_work.flops > 0
    assert vars(shortened) == vars(whole)
