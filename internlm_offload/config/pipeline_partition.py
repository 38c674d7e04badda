"""InternEvo's pipeline partition as pure functions of config values: which blocks each stage takes, which
pipeline rank runs each stage, and so which blocks a rank holds (what `cpu_offloading.num_layers` and
`model.checkpoint` count under a pipeline). engine/pipeline_split.py cuts the model by them.

Stages are numbered in the order a micro-batch runs through them (torch's stage index): chunk c's stage on
its j-th rank in pipeline order is `c * P + j`.
"""

from __future__ import annotations


def partition_uniform(num_layers: int, size: int, num_chunks: int) -> list[tuple[int, int]]:
    """Block ranges `[start, end)` per stage, in stage order: each chunk takes `num_layers / num_chunks` blocks,
    split evenly over its `size` stages, the remainder one block each to the chunk's LAST stages (InternEvo's
    `partition_uniform`; the embedding and head weigh nothing)."""
    if num_layers % num_chunks:
        raise ValueError(f"{num_layers} blocks do not split into {num_chunks} chunks")
    per_chunk = num_layers // num_chunks
    base, extra = divmod(per_chunk, size)
    if base == 0:
        raise ValueError(f"{per_chunk} blocks per chunk leave a stage of {size} without a block")
    ranges, start = [], 0
    for _ in range(num_chunks):
        for position in range(size):
            count = base + (position >= size - extra)
            ranges.append((start, start + count))
            start += count
    return ranges


def stage_rank(stage: int, size: int, v_shape: bool) -> int:
    """The pipeline rank that runs `stage`: round robin ("loop"), or down and back up for ZBV ("v": rank r holds
    stages r and 2P - 1 - r, so the first and the last stage share rank 0)."""
    chunk, position = divmod(stage, size)
    if v_shape and chunk % 2:
        return size - 1 - position
    return position


def local_stages(rank: int, size: int, num_chunks: int, v_shape: bool) -> list[int]:
    """The stages pipeline rank `rank` runs, in chunk order."""
    return [s for s in range(size * num_chunks) if stage_rank(s, size, v_shape) == rank]


def rank_blocks(num_layers: int, size: int, num_chunks: int, rank: int, v_shape: bool) -> list[int]:
    """The global indices of pipeline rank `rank`'s blocks, in stage order."""
    ranges = partition_uniform(num_layers, size, num_chunks)
    return [block for stage in local_stages(rank, size, num_chunks, v_shape) for block in range(*ranges[stage])]
