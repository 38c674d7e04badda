"""The `parallel` section: data-parallel wrapper, InternEvo's tensor, weight, expert and pipeline sub-sections."""

from typing import Literal

from pydantic import Field

from internlm_offload.config.base import Section
from internlm_offload.config.pipeline import PipelineConfig


class TensorParallelConfig(Section):
    size: int = Field(
        1,
        ge=1,
        description="Tensor-parallel group size T (innermost: ranks r..r+T-1 form one group; under a "
        "pipeline within each stage).",
    )
    mode: Literal["mtp", "msp", "fsp", "isp"] = Field(
        "mtp",
        description="InternEvo's tensor mode: `mtp` (column/row-parallel projections, activations replicated), "
        "`msp` (mtp + sequence-sharded activations between them), `fsp` (msp, backward gathers the sequence again "
        "instead of keeping it), `isp` (each rank 1/T of every sequence, Ulysses attention, weights whole or "
        "sharded over `parallel.weight`; needs `parallel.mode` ddp or fsdp2). docs/parallelism.md. "
        '`"auto"` (with `memory_budget`): the planner chooses the fastest mode that fits.',
    )


class WeightParallelConfig(Section):
    size: int = Field(
        1,
        ge=1,
        description="InternEvo's weight parallel (isp only, InternEvo's rule): FSDP2 shards the weights over groups "
        "of this many ranks and replicates them across the groups (HSDP); needs `parallel.mode='fsdp2'`. Under a "
        "pipeline: 1 or a stage's ranks (FSDP2 over the stage's data-parallel and tensor ranks alike).",
    )
    overlap: bool = Field(
        False, description="InternEvo's weight all-gather overlap; no effect without weight parallel."
    )
    memory_pool: bool = Field(False, description="InternEvo's allocator pool for weight parallel: no effect here.")


class ExpertParallelConfig(Section):
    size: int = Field(
        1,
        description="Expert parallel (docs/parallelism.md): each sparse block's routed experts split over groups of "
        "this many data-parallel ranks (every rank under isp and under mtp/msp/fsp with `no_tp`; E / size experts "
        "per rank, tokens sent to them by all-to-all; `parallel.mode` ddp or fsdp2). -1 (InternEvo's "
        "default) or <= 0: min(those ranks, model.num_experts), as InternEvo resolves -1; said in the log. "
        '`"auto"` (with `memory_budget`): the planner chooses among the sizes dividing both.',
    )
    no_tp: bool = Field(
        False,
        description="InternEvo's: experts not split over the tensor group. isp keeps them whole either way, each "
        "rank routing its own sequence chunk. Under mtp/msp/fsp with tensor size > 1 on a model with experts: False "
        "(InternEvo's default) splits every routed expert's intermediate width over the tensor group (w1/w3/b1/b3 "
        "rows, w2 columns; the shared experts column/row parallel as the dense MLP), every tensor rank routing all "
        "the tokens and the partial outputs summed over the group (expert parallel carved from the data-parallel "
        "ranks, no expert weight groups); True keeps each sparse block (router, routed and shared experts) whole on every tensor "
        "rank, each routing its own chunk of the sequence, expert parallel carved from every rank. "
        "docs/parallelism.md, Expert parallel.",
    )


class ExpertWeightParallelConfig(Section):
    size: int = Field(
        1,
        ge=1,
        description="InternEvo's expert weight parallel: FSDP2 shards each rank's experts over groups of this many "
        "expert-data ranks (ranks holding the same experts) and replicates them across the groups (HSDP); needs "
        "`parallel.mode='fsdp2'` and must divide the data-parallel size / expert size. 1 (or that whole quotient): "
        "FSDP2 shards them over all their expert-data ranks. docs/parallelism.md, Expert parallel.",
    )
    overlap: bool = Field(False, description="InternEvo's expert weight all-gather overlap; no effect here.")


class ParallelConfig(Section):
    mode: Literal["none", "ddp", "fsdp2"] = Field(
        "none",
        description="`none` (one process), `ddp`, or `fsdp2` (`fully_shard` per block, then the root). "
        '`"auto"` (with `memory_budget`): the planner chooses `ddp` or `fsdp2` (`none` or `fsdp2` with one '
        "data-parallel rank).",
    )
    reshard_after_forward: bool = Field(True, description="`fsdp2`: free unsharded params after forward (ZeRO-3).")
    bucket_cap_mb: int = Field(25, ge=1, description="`ddp`: gradient bucket size.")
    fsdp_cpu_offload: bool = Field(
        False,
        description="`fsdp2`: FSDP2's CPUOffloadPolicy: sharded params, grads and optimizer states stay on the host "
        "and the optimizer steps on the CPU (most device memory saved, slowest). Excludes the swap and hybrid optimizers. "
        '`"auto"` (with `memory_budget`): the planner chooses.',
    )
    tensor: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    weight: WeightParallelConfig = Field(default_factory=WeightParallelConfig)
    expert: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    expert_weight: ExpertWeightParallelConfig = Field(default_factory=ExpertWeightParallelConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    meta_init: bool = Field(
        True,
        description="`fsdp2` with `internlm2` (untied embeddings, fp32 or fp32-master params): build on the meta "
        "device, shard, then materialize this rank's shards as slices of the one-process build's weights (each "
        "parameter drawn whole, one at a time: one parameter's memory above the shards), so a model larger than "
        "one rank's memory starts from the same model as one process. With `model.lora.base_on_host` (none or "
        "ddp) the same meta build puts the frozen block weights straight into host memory at the compute dtype. "
        "`deepseek_v3` the same, and its `model.hf_path` (without `model.lora`) then read a tensor at a time into "
        "the shards (a rank's host peak: its shards and one tensor of the folder). Other cases build the whole model "
        "first.",
    )


__all__ = [
    "ExpertParallelConfig",
    "ExpertWeightParallelConfig",
    "ParallelConfig",
    "TensorParallelConfig",
    "WeightParallelConfig",
]
