"""The parallel layout a checkpoint was written on, as its manifest records it, and the move to another layout.

DCP stores every parameter and optimizer state whole, by name (its shards are offsets into the whole tensor), so a
checkpoint reads on any layout whose model has the same names and shapes: expert shards regroup over another
expert-parallel size, a pipeline's stages over another pipeline size or none, data and tensor shards over other
groups. What cannot move is named by the refusals that meet it, with both layouts (`describe_move`).
"""

from __future__ import annotations

from typing import Any

from internlm_offload.engine.runtime import RunContext

# The manifest's names of the parallel dims, in the order a layout is described.
DIMS = ("pipeline", "tensor", "data", "expert")


def run_layout(ctx: RunContext) -> dict[str, int]:
    """This run's layout: its ranks and the size of each parallel dim (expert ranks are carved from "data", or from
    every rank with a tensor group whose ranks route their own chunks: isp, and mtp/msp/fsp with whole experts; so
    "expert" may exceed "data")."""
    expert = ctx.expert_mesh["ep"].size() if ctx.expert_mesh is not None else 1
    return {
        "world_size": ctx.world_size,
        "pipeline": ctx.pipeline_size,
        "tensor": ctx.tensor_size,
        "data": ctx.dp_size,
        "expert": expert,
    }


def saved_layout(manifest: dict[str, Any]) -> dict[str, int]:
    """The layout a manifest records; a checkpoint written before manifests held one knows its world size only."""
    return manifest.get("layout") or {"world_size": manifest["world_size"]}


def describe_layout(layout: dict[str, int]) -> str:
    """'4 ranks (pipeline 4)', '2 ranks (data 2, expert 2)', '1 rank'."""
    ranks = layout["world_size"]
    dims = [f"{dim} {layout[dim]}" for dim in DIMS if layout.get(dim, 1) > 1]
    return f"{ranks} rank{'s' if ranks != 1 else ''}" + (f" ({', '.join(dims)})" if dims else "")


def same_layout(saved: dict[str, int], current: dict[str, int]) -> bool:
    """Whether the dims `saved` records are `current`'s (an old manifest's world size alone counts as a match)."""
    return all(current.get(key) == value for key, value in saved.items())


def describe_move(saved: dict[str, int], current: dict[str, int]) -> str:
    """'saved on 2 ranks (data 2, expert 2), loading on 4 ranks (data 4, expert 4)'."""
    return f"saved on {describe_layout(saved)}, loading on {describe_layout(current)}"
