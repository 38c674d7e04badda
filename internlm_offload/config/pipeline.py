"""InternEvo's pipeline section (`parallel.pipeline`, `model.num_chunks`): the schema, the schedules' rules on
micro-batches, and what does not compose with a pipeline yet (one-line refusals, docs/parallelism.md).

Pure functions of config values: the engine (engine/pipeline.py) builds what these accept.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from internlm_offload.config.base import Section
from internlm_offload.config.mtp import mtp_depth
from internlm_offload.config.pipeline_partition import rank_blocks
from internlm_offload.family import block_count, blocks_key, capabilities, families_with, routed_experts

PIPELINE_MODES = ("1F1B", "ZBH1", "ZBV")
PIPELINE_KNOBS = ("parallel.pipeline.size", "parallel.pipeline.mode", "model.num_chunks")  # "auto" picks a layout


class PipelineConfig(Section):
    size: int = Field(
        1,
        ge=1,
        description="Pipeline stages' ranks P (outermost: ranks r, r + W/P, ... form one pipeline); with "
        '`parallel.tensor.size` T one ("pp", "dp", "tp") mesh of shape (P, W/(P*T), T), tensor innermost.',
    )
    interleaved_overlap: bool = Field(
        False,
        description="InternEvo's communication overlap of the interleaved schedule: no effect here (torch's "
        "schedules send and receive themselves); read as written.",
    )
    mode: Literal["1F1B", "ZBH1", "ZBV"] = Field(
        "1F1B",
        description="`1F1B` (interleaved 1F1B when `model.num_chunks` > 1), `ZBH1` (zero bubble, one chunk per "
        "rank), `ZBV` (zero bubble over two chunks per rank placed in a V). torch.distributed.pipelining's "
        "schedules; docs/parallelism.md.",
    )

    @model_validator(mode="before")
    @classmethod
    def _size_alone(cls, value: Any) -> Any:
        """InternEvo also writes `pipeline=2` for `pipeline=dict(size=2)`."""
        return {"size": value} if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("mode", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value  # InternEvo upper-cases it too


def virtual_chunks(mode: str, num_chunks: int) -> int:
    """Chunks (virtual stages) per rank: ZBV always runs two, as InternEvo forces."""
    return 2 if mode == "ZBV" else num_chunks


# Features not built under a pipeline yet: the key, its value when off, what a config sets.
_NOT_UNDER_PIPELINE: tuple[tuple[str, Any, str], ...] = (
    ("parallel.expert.size", 1, "pipeline with expert parallel is not built yet; set parallel.expert.size=1"),
    ("model.tie_word_embeddings", False, "the embedding and the head sit on different stages; set False"),
    ("model.balancing_loss", None, "the balancing loss is not split over stages yet; set None"),
    ("data.valid_folder", None, "validation runs the whole model on one rank; not built under a pipeline yet"),
)


def _value(cfg: Section, key: str) -> Any:
    value: Any = cfg
    for name in key.split("."):
        value = getattr(value, name)
    return value


def pipeline_problem(cfg: Any) -> str | None:
    """The first thing `cfg` (a RunConfig: its module imports this one) asks of a pipeline
    (`parallel.pipeline.size` > 1) that is not built yet, as one line; None if nothing."""
    pipe, model = cfg.parallel.pipeline, cfg.model
    where = f"parallel.pipeline.size={pipe.size}"
    if not capabilities(model.type).pipeline:
        return f"{where} splits model.type={families_with('pipeline')}, not {model.type!r}"
    if cfg.parallel.fsdp_cpu_offload:
        return (
            f"{where} with parallel.fsdp_cpu_offload=True: FSDP2's CPU offload per stage is not checked yet; set False"
        )
    if mtp_depth(model) and cfg.parallel.tensor.size > 1:
        return (
            f"{where} with model.mtp_config.num_layers={mtp_depth(model)} and parallel.tensor.size="
            f"{cfg.parallel.tensor.size}: multi-token prediction's stage inputs under a tensor mode are not checked "
            "yet; set parallel.tensor.size=1 or model.mtp_config=dict(num_layers=0)"
        )
    for key, off, why in _NOT_UNDER_PIPELINE:
        value = _value(cfg, key)
        if value != off:
            return f"{where} with {key}={value!r}: {why}"
    return (
        _experts_problem(cfg)
        or checkpoint_problem(pipe.mode, model.checkpoint)
        or _chunk_problem(pipe.size, pipe.mode, model.num_chunks, block_count(model), blocks_key(model))
        or _offload_problem(cfg)
    )


def _experts_problem(cfg: Any) -> str | None:
    """A mixture of experts splits over stages (each stage backpropagates its sparse blocks' auxiliary losses and
    counts their routers' choices: engine/stage_aux_loss.py, model/moe.py `BiasBlocks`), except the global
    load-balancing loss, whose statistics pool over all blocks before its product, and a stage's tensor group, whose
    ranks each hold their chunk's auxiliary loss (the step's reduction over a stage's tensor ranks keeps one)."""
    model, where = cfg.model, f"parallel.pipeline.size={cfg.parallel.pipeline.size}"
    if not routed_experts(model):
        return None
    if model.num_experts and not model.moe_layer_kwargs.aux_loss_by_layer:
        return (
            f"{where} with model.moe_layer_kwargs.aux_loss_by_layer=False: the global load-balancing loss pools the "
            "router statistics of all blocks, which sit on different stages; set True (InternEvo's per-layer loss)"
        )
    tensor = cfg.parallel.tensor
    if tensor.size > 1:
        return (
            f"{where} with parallel.tensor.size={tensor.size} on a mixture of experts: a stage's tensor group under "
            "experts is not checked yet; set parallel.tensor.size=1"
        )
    return None


def stage_sequence_parts(cfg: Any) -> int:
    """The parts each tensor group splits the hidden states between stages into: T under msp, fsp and isp (each
    tensor rank sends its part of the sequence), 1 under mtp (whole on every tensor rank)."""
    tensor = cfg.parallel.tensor
    return 1 if tensor.mode == "mtp" else tensor.size


def pipeline_rank_blocks(cfg: Any, rank: int) -> list[int]:
    """The global indices of pipeline rank `rank`'s blocks in stage order (what its layer plan counts), for `cfg`
    (a RunConfig) with a valid partition."""
    pipe = cfg.parallel.pipeline
    chunks = virtual_chunks(pipe.mode, cfg.model.num_chunks)
    return rank_blocks(block_count(cfg.model), pipe.size, chunks, rank, v_shape=pipe.mode == "ZBV")


def _offload_problem(cfg: Any) -> str | None:
    """`cpu_offloading.num_layers` counts each pipeline rank's own blocks (its entry of a list), the last of them
    never offloaded."""
    offload = cfg.cpu_offloading
    for rank in range(cfg.parallel.pipeline.size):
        blocks = len(pipeline_rank_blocks(cfg, rank))
        if offload.layers_on(rank) >= blocks:
            return (
                f"cpu_offloading.num_layers={offload.num_layers} must be < {blocks} on pipeline rank {rank}: under a "
                "pipeline it counts the rank's own blocks, and the last is never offloaded"
            )
    return None


def checkpoint_problem(mode: str, checkpoint: Any) -> str | None:
    """Activation checkpointing (full or selective) runs under the schedules with a whole backward (1F1B,
    interleaved 1F1B); the zero-bubble ones split it into an input and a weight pass, and torch's weight pass fails
    on a checkpointed block (checked: `'_GeneratorContextManager' object has no attribute 'args'`)."""
    if mode in ("ZBH1", "ZBV") and checkpoint not in (0, 0.0, False):
        return (
            f"parallel.pipeline.mode={mode!r} with model.checkpoint={checkpoint!r}: torch's zero-bubble split "
            "backward fails on checkpointed blocks; set model.checkpoint=0 or mode='1F1B'"
        )
    return None


def _chunk_problem(size: int, mode: str, num_chunks: int, num_layers: int, key: str) -> str | None:
    """The partition's rules on the model's `num_layers` blocks (the family's count, named by `key`)."""
    if mode == "ZBH1" and num_chunks != 1:
        return f"parallel.pipeline.mode='ZBH1' with model.num_chunks={num_chunks}: ZBH1 runs one chunk per rank; set 1"
    if mode == "ZBV" and num_chunks not in (1, 2):
        return f"parallel.pipeline.mode='ZBV' with model.num_chunks={num_chunks}: ZBV runs two chunks per rank; set 2"
    chunks = virtual_chunks(mode, num_chunks)
    if num_layers % chunks:
        return f"{key}={num_layers} must be divisible by the {chunks} pipeline chunks per rank"
    if num_layers // chunks < size:
        return (
            f"{key}={num_layers} over {size} pipeline ranks x {chunks} chunks leaves a stage without a "
            "block; lower parallel.pipeline.size or model.num_chunks"
        )
    return None


def micro_batch_problem(size: int, mode: str, num_chunks: int, micro_num: int) -> str | None:
    """torch's schedules' rules on the micro-batches per step (`data.micro_num`), as one line, or None."""
    chunks = virtual_chunks(mode, num_chunks)
    if chunks == 1 and mode == "1F1B" and micro_num < size:
        return (
            f"data.micro_num={micro_num} with parallel.pipeline.size={size}: 1F1B needs at least one micro-batch "
            f"per stage; set data.micro_num >= {size}"
        )
    rounds = max(1, micro_num // size)
    if chunks > 1 or mode != "1F1B":
        if micro_num % rounds:
            return (
                f"data.micro_num={micro_num} with parallel.pipeline.size={size} (mode {mode!r}, {chunks} chunks): "
                f"the schedule runs micro_num // {size} = {rounds} rounds, which must divide it; set a multiple of "
                f"{size}"
            )
    return None


def splits_backward(mode: str) -> bool:
    """The zero-bubble schedules split each backward into an input and a weight pass, which DDP's reducer follows
    neither of (checked: the gradient norm off from step 1): under `parallel.mode='ddp'` their stages are not
    wrapped, and the trainer averages the gradients over the stage's data-parallel ranks after the last pass."""
    return mode in ("ZBH1", "ZBV")


def data_parallel_problem(
    mode: str, data_parallel: int, wrapper: str = "ddp", tensor: Any = None, weight: int = 1
) -> str | None:
    """What a stage's data-parallel ranks cannot take, as one line. FSDP2 under the zero-bubble schedules: its
    gradients after the split backward's weight passes are wrong (checked: ZBV at P=2 x FSDP2 2, the loss off one
    process's from step 2, 0.06), so they run under DDP (`splits_backward`) or with one rank per stage; nor isp over
    several tensor ranks, whose wrapper (DDP or FSDP2) reduces over them (checked: off from step 1 under both).
    `tensor`: `parallel.tensor`; `weight`: `parallel.weight.size`, isp's FSDP2 over a stage's ranks (all or 1)."""
    if splits_backward(mode) and data_parallel > 1 and wrapper == "fsdp2":
        ddp = "parallel.mode='ddp', " if tensor is None or tensor.size == 1 else ""  # DDP takes no tensor mode here
        return (
            f"parallel.pipeline.mode={mode!r} with parallel.mode='fsdp2' over {data_parallel} data-parallel ranks per "
            f"stage: FSDP2 does not reduce the zero-bubble schedules' split backward correctly yet; use {ddp}"
            "mode='1F1B' or one rank per stage"
        )
    isp = tensor is not None and tensor.mode == "isp" and tensor.size > 1
    if splits_backward(mode) and isp:
        return (
            f"parallel.pipeline.mode={mode!r} with parallel.tensor.mode='isp' (size {tensor.size}): the wrapper "
            "that sums the sequence chunks' gradients does not follow the zero-bubble split backward; use mode='1F1B'"
        )
    stage_ranks = data_parallel * (tensor.size if tensor is not None else 1)
    if weight not in (1, stage_ranks):
        return (
            f"parallel.weight.size={weight} under a pipeline: FSDP2 shards over a stage's {stage_ranks} ranks "
            f"(data-parallel x tensor) whole; sharding over groups of them is not built; set 1 or {stage_ranks}"
        )
    return None
