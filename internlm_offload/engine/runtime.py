"""Process-level runtime facts (rank, world size, device) and the seeding/determinism switches.

`RunContext` is created once by the entry point and passed explicitly; nothing here is global.
"""

import gc
import os
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from internlm_offload.device import Accelerator
from internlm_offload.torchrun_env import (  # noqa: F401  (re-exported: callers read the environment here too)
    env_local_rank,
    env_local_world_size,
    env_world_size,
    launched_by_torchrun,
)


@dataclass(frozen=True)
class RunContext:
    rank: int
    local_rank: int
    world_size: int
    accelerator: Accelerator
    # Tensor parallel: ranks r..r+T-1 (T = tensor_size) form one tensor group and read the same micro-batches;
    # `mesh` is the ("dp", "tp") DeviceMesh over the world, None without tensor parallel.
    tensor_size: int = 1
    mesh: DeviceMesh | None = None
    # Expert parallel: the ("edp", "ep") mesh over the data-parallel ranks (every rank where the tensor ranks route
    # chunks of their own), ("edp_replicate", "edp_shard", "ep") with "edp" flattened under expert weight parallel
    # (engine/expert_parallel.py), ("edp", "ep", "tp") with the experts split over the tensor group (no_tp=False);
    # None without
    expert_mesh: DeviceMesh | None = None
    # Pipeline parallel: the ("pp", "dp") mesh, stage ranks outermost (rank r is pipeline rank r // (W / P)); the
    # ranks of one stage read different micro-batches, those of one pipeline the same. None without a pipeline.
    # With tensor parallel too, one ("pp", "dp", "tp") mesh of shape (P, W / (P * T), T), pipeline outermost and
    # tensor innermost (InternEvo's order); `mesh` is then its ("dp", "tp") sub-mesh of this rank's stage.
    pipeline_size: int = 1
    pipeline_mesh: DeviceMesh | None = None
    # isp: each tensor rank's loss is its sequence chunk's, weighted as its share (the gradients average over every
    # rank); mtp/msp/fsp's tensor ranks compute the one loss of their micro-batches
    chunked_loss: bool = False

    @property
    def expert_grad_divisor(self) -> int:
        """What expert gradients, summed over their expert-data group, are divided by: the ranks whose losses the
        step averages (every rank under isp; the data-parallel ranks otherwise): the dense convention."""
        return self.world_size // self.pipeline_size if self.chunked_loss else self.dp_size

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: which micro-batches it reads."""
        return (self.rank % (self.world_size // self.pipeline_size)) // self.tensor_size

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline rank (0 without a pipeline): pipeline ranks are outermost."""
        return self.rank // (self.world_size // self.pipeline_size)

    @property
    def dp_size(self) -> int:
        """Ranks that read different micro-batches."""
        return self.world_size // (self.tensor_size * self.pipeline_size)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device(self.local_rank)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def init_runtime(
    accelerator: Accelerator,
    *,
    needs_group: bool = False,
    tensor_size: int = 1,
    expert_size: int = 1,
    expert_weight_size: int = 1,
    experts_over_tensor: bool = False,
    chunked_loss: bool = False,
    pipeline_size: int = 1,
) -> RunContext:
    """Join the process group when launched by torchrun (gloo on cpu, nccl/hccl on accelerators). Without
    torchrun, `needs_group` (the ddp and fsdp2 wrappers) makes a group of this one process. `tensor_size` > 1
    builds the ("dp", "tp") mesh, tensor ranks innermost; `expert_size` > 1 the expert mesh (`expert_mesh`, its
    expert-data ranks sharded over groups of `expert_weight_size`; over every rank with `experts_over_tensor`, the
    tensor ranks routing different chunks of the sequences: isp's, and mtp/msp/fsp's sparse blocks with whole
    experts, InternEvo's no_tp=True, whose expert tensor size 1 puts its expert ranks innermost over the tensor
    ranks: at 4 ranks, tensor 2 and expert 2 the expert groups are the tensor groups {0, 1}, {2, 3}, the expert-data
    groups {0, 2}, {1, 3}); `chunked_loss`: isp's loss weighting (`RunContext.chunked_loss`); `pipeline_size` > 1
    the ("pp", "dp") mesh, or with both the ("pp", "dp", "tp") mesh (`parallel_meshes`)."""
    if not launched_by_torchrun():
        if needs_group and not dist.is_initialized():
            dist.init_process_group(backend=accelerator.dist_backend, store=dist.HashStore(), rank=0, world_size=1)
        return RunContext(rank=0, local_rank=0, world_size=1, accelerator=accelerator)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = env_local_rank()
    accelerator.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=accelerator.dist_backend)
    mesh, pipeline = parallel_meshes(accelerator.name, world_size, tensor_size, pipeline_size)
    ranks = world_size if experts_over_tensor else world_size // tensor_size
    experts = None
    if expert_size > 1:  # carved from the data-parallel ranks alone: the experts split over "tp" (no_tp=False)
        experts = expert_mesh(accelerator.name, ranks, expert_size, expert_weight_size, world_size // ranks)
    return RunContext(
        rank, local_rank, world_size, accelerator, tensor_size, mesh, experts, pipeline_size, pipeline, chunked_loss
    )


def parallel_meshes(
    device_type: str, world_size: int, tensor_size: int, pipeline_size: int
) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """The tensor mesh ("dp", "tp") and the pipeline mesh, each None where its size is 1. With both, one
    ("pp", "dp", "tp") mesh of shape (P, W / (P * T), T), pipeline outermost, tensor innermost (InternEvo's order):
    the tensor mesh is its ("dp", "tp") sub-mesh of this rank's stage, so each rank's "pp" group joins the ranks
    of the same (dp, tp) coordinate in every stage, and a tensor rank sends its shard to the same tensor rank of
    the next stage."""
    if pipeline_size == 1:
        return tensor_parallel_mesh(device_type, world_size, tensor_size), None
    if tensor_size == 1:
        return None, pipeline_mesh(device_type, world_size, pipeline_size)
    shape = (pipeline_size, world_size // (pipeline_size * tensor_size), tensor_size)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp", "tp"))
    return mesh["dp", "tp"], mesh


def tensor_parallel_mesh(device_type: str, world_size: int, tensor_size: int) -> DeviceMesh | None:
    """The ("dp", "tp") mesh over the process group, tensor ranks innermost; None without tensor parallel."""
    if tensor_size == 1:
        return None
    return init_device_mesh(device_type, (world_size // tensor_size, tensor_size), mesh_dim_names=("dp", "tp"))


def pipeline_mesh(device_type: str, world_size: int, pipeline_size: int) -> DeviceMesh:
    """The ("pp", "dp") mesh over the process group, pipeline ranks outermost (InternEvo's order)."""
    return init_device_mesh(device_type, (pipeline_size, world_size // pipeline_size), mesh_dim_names=("pp", "dp"))


def expert_mesh(
    device_type: str, data_parallel: int, expert_size: int, expert_weight: int = 1, tensor: int = 1
) -> DeviceMesh:
    """The ("edp", "ep") mesh over the data-parallel ranks, expert ranks innermost (InternEvo's order: the ranks
    of an expert group are contiguous, those holding the same experts at stride `expert_size`).

    `tensor` T > 1: the experts are split over the tensor group too (`parallel.expert.no_tp=False`), so the expert
    dims are carved from the data-parallel ranks of a ("edp", "ep", "tp") mesh over the world, tensor ranks innermost
    as in the ("dp", "tp") mesh (InternEvo's expert tensor group is the tensor group): the ranks of an "ep" group
    share a tensor rank and hold the same slice of different experts.

    `expert_weight` W between 1 and the expert-data size: ("edp_replicate", "edp_shard", "ep"), the expert-data
    ranks split into replicas of shard groups of W (at stride `expert_size`, "ep" stays innermost), with the two
    flattened back into "edp" (the expert-data group as a whole)."""
    expert_data = data_parallel // expert_size
    if tensor > 1:  # expert weight groups with it are refused (config/resolve.py)
        return init_device_mesh(device_type, (expert_data, expert_size, tensor), mesh_dim_names=("edp", "ep", "tp"))
    if expert_weight in (1, expert_data):
        return init_device_mesh(device_type, (expert_data, expert_size), mesh_dim_names=("edp", "ep"))
    shape = (expert_data // expert_weight, expert_weight, expert_size)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("edp_replicate", "edp_shard", "ep"))
    mesh["edp_replicate", "edp_shard"]._flatten("edp")
    return mesh


def expert_data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """What FSDP2 shards the experts over: the whole expert-data dim, or under expert weight parallel its
    (replicate, shard) dims (HSDP: sharded within groups of W, replicated across them)."""
    return mesh["edp_replicate", "edp_shard"] if _split_expert_data(mesh) else mesh["edp"]


def all_expert_data(mesh: DeviceMesh) -> DeviceMesh:
    """The expert-data ranks as one dim (the ranks holding this rank's experts), whatever the expert mesh."""
    # _flatten hands back the flattened dim `expert_mesh` made (torch deprecates slicing it from the root)
    return mesh["edp_replicate", "edp_shard"]._flatten("edp") if _split_expert_data(mesh) else mesh["edp"]


def _split_expert_data(mesh: DeviceMesh) -> bool:
    return "edp_shard" in (mesh.mesh_dim_names or ())


def data_parallel_group(ctx: RunContext) -> dist.ProcessGroup | None:
    """The group gradients are averaged over: the mesh's "dp" dim under tensor parallel, a stage's data-parallel
    ranks under a pipeline, else the world (None)."""
    if ctx.pipeline_mesh is not None:
        return ctx.pipeline_mesh["dp"].get_group()
    return ctx.mesh["dp"].get_group() if ctx.mesh is not None else None


def stage_data_mesh(ctx: RunContext, over_tensor: bool = False) -> DeviceMesh:
    """A pipeline stage's ranks its gradients are averaged over: its "dp" dim, or with `over_tensor` (isp, whose
    tensor ranks hold different chunks of the sequences) its ("dp", "tp") dims flattened into one."""
    mesh = ctx.pipeline_mesh
    assert mesh is not None, "a pipeline's mesh"
    if over_tensor and "tp" in (mesh.mesh_dim_names or ()):
        return mesh["dp", "tp"]._flatten("dp_tp")
    return mesh["dp"]


def shutdown_runtime() -> None:
    if dist.is_available() and dist.is_initialized():
        # FSDP2 modules and DTensors hold the group in reference cycles. Left to the interpreter's exit, they
        # die mid-finalization, where tearing down a gloo worker thread can abort the process (SIGABRT after a
        # finished run; seen in about 1 of 12 two-rank runs of tests/unit/test_hybrid_optimizer.py's script).
        gc.collect()
        dist.destroy_process_group()


def barrier(ctx: RunContext) -> None:
    if ctx.distributed:
        dist.barrier()


def all_gather_object(ctx: RunContext, obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order; `[obj]` in one process."""
    if not ctx.distributed:
        return [obj]
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def set_determinism(seed: int, deterministic: bool, accelerator: Accelerator) -> None:
    """Seed every RNG from one seed; in deterministic mode also force deterministic kernels."""
    random.seed(seed)
    torch.manual_seed(seed)
    accelerator.manual_seed_all(seed)
    if not deterministic:
        return
    # cuBLAS needs a fixed workspace for reproducible GEMMs; must be set before the first cuBLAS call.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # The uninitialised-memory fill kernels would race with side-stream copies into fresh buffers.
    torch.utils.deterministic.fill_uninitialized_memory = False
