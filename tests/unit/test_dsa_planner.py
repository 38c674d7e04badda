"""The planner's trace of DSA (model/meta_trace.py): on meta, the indexer's and the sparse kernel's query-chunk loops
run their first two chunks and count the rest's matrix work in one stand-in op; the trace's every figure is the one
of the loops run whole (memory, FLOPs, the segments the search composes from), at two sequences and with chunks small
enough that each loop runs many (the tiny GLM-5, its blocks full, shared, full, shared; top-k 16)."""

import pytest

from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.model import indexer, meta_trace, sparse_attention
from internlm_offload.planner import trace


@pytest.mark.parametrize("seq_len", [128, 256])
@pytest.mark.parametrize("checkpoint", [0.0, 0.5])
def test_the_shortened_trace_gives_every_figure_of_the_whole_loops(monkeypatch, seq_len, checkpoint):
    options = {"data.seq_len": seq_len, "data.micro_num": 1, "data.micro_bsz": 1, "model.checkpoint": checkpoint}
    cfg = resolve_config(load_config_file("configs/glm5_tiny.py", options), world_size=1)
    # chunks of 8 queries in both loops (at 256 tokens: 32 chunks a loop, of which 2 traced)
    monkeypatch.setattr(indexer, "CHUNK_ELEMENTS", 8 * 8 * seq_len)  # Hi = 8 heads over the sequence
    monkeypatch.setattr(sparse_attention, "CHUNK_ELEMENTS", 8 * 16 * 4 * (32 + 16))  # K 16, 4 heads, dq 32, dv 16
    shortened = trace.trace_step(cfg, 1)
    monkeypatch.setattr(meta_trace, "TRACED_CHUNKS", 1 << 30)
    whole = trace.trace_step(cfg, 1)
    assert shortened.micro_batch_work.flops > 0
    assert vars(shortened) == vars(whole)
