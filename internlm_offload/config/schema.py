"""The whole run's configuration: `RunConfig`, its sections (sections.py) and the checks across them.

This module and `resolve.py` are the only places that know the config schema. Config files are plain Python
with literals only, loaded by `file.py` (mmengine `Config.fromfile`, `_base_` inheritance, `--cfg-options`
overrides); the typed schema (pydantic, unknown keys forbidden) checks every key, fills defaults and derives the
values that depend on other keys; `resolve.py` adds what depends on the world size and the "auto" knobs.

Every problem is reported as one `ConfigError` line naming the key, the bad value and what is allowed.
"""

import hashlib
import json
from typing import Literal, Optional

from pydantic import Field, PrivateAttr, model_validator

from internlm_offload.config.internevo import Translation
from internlm_offload.config.lora import base_on_host_problem
from internlm_offload.config.moe import balancing_problem
from internlm_offload.config.optimizer import OptimizerConfig, shared_lr_problem
from internlm_offload.config.parallel import ParallelConfig
from internlm_offload.config.pipeline import pipeline_problem
from internlm_offload.config.quantization import quantization_problem
from internlm_offload.config.sections import (
    AdamConfig,
    CkptConfig,
    CpuOffloadingConfig,
    CustomImportsConfig,
    DataConfig,
    GradScalerConfig,
    HybridOptimizerConfig,
    HybridZeroOptimizerConfig,
    LossConfig,
    LrSchedulerConfig,
    MemoryBudgetConfig,
    MixedPrecisionConfig,
    ModelConfig,
    MonitorConfig,
    NvmeOffloadConfig,
    Section,
    intermediate_size,
)
from internlm_offload.family import block_count, blocks_key, capabilities, families_with, routed_experts


class RunConfig(Section):
    """The whole resolved run configuration."""

    JOB_NAME: str = Field(
        "internlm2_tiny", min_length=1, description="Run name; default work dir `work_dirs/<JOB_NAME>`."
    )
    seed: int = Field(1024, ge=0, description="Seeds model init, data order and every RNG.")
    deterministic: bool = Field(True, description="Deterministic algorithms: bitwise-reproducible runs.")
    device: Literal["auto", "cpu", "cuda", "npu"] = Field(
        "auto", description="Accelerator; `auto` picks cuda > npu > cpu."
    )
    custom_imports: Optional[CustomImportsConfig] = Field(
        None, description="mmengine's: modules imported as the file loads, e.g. a model family's package."
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    adam: AdamConfig = Field(default_factory=AdamConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    lr_scheduler: LrSchedulerConfig = Field(default_factory=LrSchedulerConfig)
    hybrid_zero_optimizer: HybridZeroOptimizerConfig = Field(default_factory=HybridZeroOptimizerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    ckpt: CkptConfig = Field(default_factory=CkptConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    cpu_offloading: CpuOffloadingConfig = Field(default_factory=CpuOffloadingConfig)
    selective_checkpoint: bool = Field(
        False, description="Checkpointed blocks keep matmul/attention outputs and recompute only cheap ops."
    )
    selective_checkpoint_offload: bool = Field(
        False, description="Also offload what the selective policy keeps; needs `selective_checkpoint`."
    )
    swap_optimizer: bool = Field(
        False,
        description="AdamW states live on the host and visit the device inside `step()` (bitwise equal to AdamW). "
        "Frees ~8 bytes per parameter of device memory, costs two host transfers of the states per step. "
        '`"auto"` (with `memory_budget`): the planner chooses.',
    )
    swap_optimizer_times: int = Field(
        16, ge=1, description="The swap optimizer holds at most 1/N of the states on the device at a time."
    )
    use_pinned_optimizer_offload: bool = Field(
        False,
        description="Pin the swap optimizer's host slab (all states, one copy per chunk each way), so its copies "
        "overlap on a device; False keeps the slab pageable (copies then block the host). Needs `swap_optimizer`.",
    )
    hybrid_optimizer: HybridOptimizerConfig = Field(default_factory=HybridOptimizerConfig)
    grad_offload: bool = Field(
        False,
        description="ZeRO-Offload's gradient schedule: each gradient goes to host memory as backward produces it "
        "(bucketed, on a copy stream) and accumulates there in fp32; the device never holds the fp32 gradient "
        "buffer (4 bytes per parameter). Needs `swap_optimizer` or `hybrid_optimizer` with `offload_fraction=1.0`, "
        "(excludes `parallel.fsdp_cpu_offload`, which moves FSDP2's gradient shards itself). Under DDP the host "
        "gradients are averaged bucket by bucket after backward; under FSDP2 the reduce-scattered shards move. "
        "Bitwise equal to the run without it. "
        '`"auto"` (with `memory_budget`): the planner chooses.',
    )
    nvme_offload: NvmeOffloadConfig = Field(default_factory=NvmeOffloadConfig)
    grad_offload_bucket_mb: float = Field(
        32.0,
        gt=0,
        description="Gradient offload copies gradients to the host in buckets of about this many MiB (a larger "
        "gradient alone); two pinned staging buffers of this size (or of the largest gradient) take them.",
    )
    mixed_precision: MixedPrecisionConfig = Field(default_factory=MixedPrecisionConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    grad_scaler: GradScalerConfig = Field(default_factory=GradScalerConfig)
    max_skipped_steps: int = Field(
        20,
        ge=1,
        description="Non-finite guard: a step whose loss or gradient norm is not finite skips the update (fp16 "
        "overflows included); after this many consecutive skipped steps the run stops with exit code 3 and no "
        "checkpoint of the bad state.",
    )
    memory_budget: MemoryBudgetConfig = Field(default_factory=MemoryBudgetConfig)
    preflight: bool = Field(
        True,
        description="Before allocating the model, trace one step on meta tensors (seconds) and stop with exit code 2 "
        "when its predicted device or host peak exceeds this machine's memory (see docs/planner.md).",
    )

    _migration: Translation | None = PrivateAttr(default=None)
    _auto_knobs: tuple[str, ...] = PrivateAttr(default=())
    _warnings: list[str] = PrivateAttr(default_factory=list)  # settings that take no effect as written
    _derived: list[str] = PrivateAttr(default_factory=list)  # values resolved from the world size, for the log

    @property
    def auto_knobs(self) -> tuple[str, ...]:
        """The knobs the config left to the planner (`"auto"`); they hold placeholder values until it chose."""
        return self._auto_knobs

    def migration_notes(self) -> tuple[list[str], list[str]]:
        """What the InternEvo key translation did to this config, and the settings that take no effect as written:
        (info lines, warnings) for the start-up log."""
        warnings = list(self._warnings)
        t = self._migration
        if t is None:
            return list(self._derived), warnings
        notes = [f"InternEvo key: {line}" for line in t.mapped] + self._derived
        if t.ignored:
            notes.append(f"InternEvo keys without effect here, ignored: {', '.join(t.ignored)}")
        return notes, warnings + list(t.warnings)

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        if problem := shared_lr_problem(self.optimizer, self.adam.lr, "lr" in self.adam.model_fields_set):
            raise ValueError(problem)
        if self.optimizer.lr is not None:
            self.adam.lr = self.optimizer.lr  # one value: `adam.lr` is what the optimizers and schedule read
        offload = self.cpu_offloading
        if not offload.enable and offload.most_layers != 0:
            raise ValueError(f"cpu_offloading.num_layers={offload.num_layers} needs cpu_offloading.enable=True")
        self._check_offload_per_rank()
        blocks = block_count(self.model)
        if offload.most_layers >= blocks:
            raise ValueError(
                f"cpu_offloading.num_layers={offload.num_layers} must be < {blocks_key(self.model)}={blocks} "
                "(the last block is never offloaded)"
            )
        if self.selective_checkpoint_offload and not self.selective_checkpoint:
            raise ValueError("selective_checkpoint_offload=True needs selective_checkpoint=True")
        if self.swap_optimizer and self.hybrid_optimizer.enable:
            raise ValueError("swap_optimizer=True and hybrid_optimizer.enable=True exclude each other; choose one")
        if self.parallel.fsdp_cpu_offload and self.parallel.mode != "fsdp2":
            raise ValueError(f"parallel.fsdp_cpu_offload=True needs parallel.mode='fsdp2', got {self.parallel.mode!r}")
        if self.parallel.fsdp_cpu_offload and (self.swap_optimizer or self.hybrid_optimizer.enable):
            raise ValueError(
                "parallel.fsdp_cpu_offload=True already keeps the optimizer states on the host; "
                "it excludes swap_optimizer and hybrid_optimizer.enable"
            )
        if self.grad_offload:
            self._check_grad_offload()
        if self.nvme_offload.enable:
            self._check_nvme()
        elif self.nvme_offload.path is not None:
            self._warnings.append(
                f"nvme_offload.path={self.nvme_offload.path!r} is set but nvme_offload.enable=False: the optimizer "
                "states stay in host memory; set nvme_offload.enable=True to keep them in files there"
            )
        if self.use_pinned_optimizer_offload and not self.swap_optimizer:
            raise ValueError(
                "use_pinned_optimizer_offload=True is the host arena of the swap optimizer; it needs swap_optimizer=True"
            )
        heads, kv_heads = self.model.num_attention_heads, self.model.num_kv_attention_heads
        if heads % kv_heads:
            raise ValueError(
                f"model.num_attention_heads={heads} must be divisible by model.num_kv_attention_heads={kv_heads}"
            )
        if self.model.head_dim is None and self.model.hidden_size % heads:
            raise ValueError(
                f"model.hidden_size={self.model.hidden_size} must be divisible by model.num_attention_heads={heads}, "
                f"and that by model.num_kv_attention_heads={kv_heads}"
            )
        if problem := balancing_problem(self):
            raise ValueError(problem)
        if self.parallel.pipeline.size > 1 and (problem := pipeline_problem(self)):
            raise ValueError(problem)
        if self.parallel.tensor.size > 1 or self.parallel.weight.size > 1:
            self._check_tensor_parallel()
        if self.model.lora is not None and (self.parallel.tensor.size > 1 or self.parallel.weight.size > 1):
            raise ValueError(
                "model.lora with parallel.tensor.size > 1 or parallel.weight.size > 1: adapters are not split over "
                "the tensor group yet; use parallel.mode 'none', 'ddp' or 'fsdp2' alone"
            )
        if problem := base_on_host_problem(self):
            raise ValueError(problem)
        if problem := quantization_problem(self):
            raise ValueError(problem)
        info = self.ckpt.load_ckpt_info
        if info is not None and info.ckpt_type != "internevo" and not capabilities(self.model.type).foreign_weights:
            raise ValueError(
                f"ckpt.load_ckpt_info.ckpt_type={info.ckpt_type!r} loads into model.type="
                f"{families_with('foreign_weights')}; for model.type={self.model.type!r} give "
                "the folder as model.hf_path"
            )
        profile_step, last_step = self.monitor.profile_step, self.data.total_steps
        if profile_step > last_step:
            raise ValueError(
                f"monitor.profile_step={profile_step} is after the run's last step (data.total_steps={last_step}): "
                f"give a step from 1 to {last_step}, or 0 for none"
            )
        if self.data.type == "text" and not self.data.paths:
            raise ValueError("data.type='text' needs data.paths (files or folders of .txt/.jsonl)")
        return self

    def _check_offload_per_rank(self) -> None:
        """A list of counts gives each pipeline rank its own: one entry per rank, only under a pipeline."""
        layers, pipe = self.cpu_offloading.num_layers, self.parallel.pipeline.size
        if isinstance(layers, list) and len(layers) != pipe:
            raise ValueError(
                f"cpu_offloading.num_layers={layers} has {len(layers)} entries: a list gives each pipeline rank its "
                f"count, and parallel.pipeline.size={pipe}; give {pipe} entries"
                + ("" if pipe > 1 else " (one count without a pipeline: an int)")
            )

    def _check_tensor_parallel(self) -> None:
        """What the tensor modes need of the model and which features compose with them (docs/parallelism.md)."""
        tensor, weight, model = self.parallel.tensor, self.parallel.weight, self.model
        if weight.size > 1 and tensor.mode != "isp":
            raise ValueError(
                f"parallel.weight.size={weight.size} works only with parallel.tensor.mode='isp' (InternEvo's rule), "
                f"got mode={tensor.mode!r}; set weight.size=1"
            )
        T, mode = tensor.size, tensor.mode
        # isp keeps the experts whole (its ranks route their own sequence chunks, as InternEvo's do); mtp/msp/fsp
        # keep them whole with InternEvo's no_tp=True (engine/moe_tensor_parallel.py) and split each expert over the
        # tensor group with its no_tp=False (engine/expert_tensor_parallel.py)
        experts = routed_experts(model)
        if not capabilities(model.type).tensor_parallel:
            raise ValueError(
                f"parallel.tensor (size {T}, mode {mode!r}) splits model.type="
                f"{families_with('tensor_parallel')}, not {model.type!r}"
            )
        divisible = {}
        # a model read from a Hugging Face folder or config has its dimensions there, not in this section: its tensor
        # plan's heads are checked when the model is split (engine/tensor_parallel.py)
        own_dims = model.hf_path is None and model.hf_config is None
        if own_dims:
            divisible["model.num_attention_heads"] = model.num_attention_heads
        kv_heads = model.num_kv_attention_heads or model.num_attention_heads
        if own_dims and kv_heads % T and T % kv_heads:  # kv heads repeated up to T (Ulysses, KVHeadReplicas)
            raise ValueError(
                f"parallel.tensor.size={T} (mode {mode!r}) and model.num_kv_attention_heads={kv_heads}: one must "
                "divide the other (each rank attends with whole kv heads, repeated where T exceeds them)"
            )
        if mode == "isp":
            self._check_isp_wrapper()
        else:
            self._check_column_row_parallel()
            if own_dims:
                width = intermediate_size(model.hidden_size, model.mlp_ratio, model.multiple_of)
                divisible["the SwiGLU width (model.hidden_size * mlp_ratio rounded up to multiple_of)"] = width
        # the modes that split the sequence; mtp too where the sparse blocks route a chunk each (whole experts)
        if mode in ("msp", "fsp", "isp") or (experts and self.parallel.expert.no_tp):
            divisible["data.seq_len"] = self.data.seq_len
        for name, value in divisible.items():
            if value % T:
                raise ValueError(
                    f"parallel.tensor.size={T} (mode {mode!r}) must divide {name}={value}: each rank holds "
                    f"1/{T} of it; choose a tensor size that divides it"
                )

    def _check_column_row_parallel(self) -> None:
        """mtp / msp / fsp: the parameters become DTensors over the tensor group."""
        T = self.parallel.tensor.size
        if self.parallel.mode == "ddp":
            raise ValueError(
                f"parallel.mode='ddp' with parallel.tensor.size={T}: DDP does not take torch's tensor-parallel "
                "DTensors; use parallel.mode='fsdp2' (FSDP2 over the data-parallel dim, tensor groups inside)"
            )
        if self.model.tie_word_embeddings:
            raise ValueError(f"parallel.tensor.size={T}: model.tie_word_embeddings=True is not sharded here; set False")

    def _check_isp_wrapper(self) -> None:
        """isp: weights stay whole (or FSDP2 over the weight group); the data-parallel wrapper over all ranks
        sums the gradients each rank computes from its chunk of the sequence."""
        T, weight = self.parallel.tensor.size, self.parallel.weight.size
        if T > 1 and self.parallel.mode == "none":
            raise ValueError(
                f"parallel.tensor.mode='isp' with size {T} needs parallel.mode 'ddp' or 'fsdp2': the wrapper sums "
                "the gradients each rank computes from its chunk of the sequence"
            )
        if weight > 1 and self.parallel.mode != "fsdp2":
            raise ValueError(
                f"parallel.weight.size={weight} shards the weights with FSDP2: set parallel.mode='fsdp2', "
                f"got {self.parallel.mode!r}"
            )

    def _check_grad_offload(self) -> None:
        hybrid = self.hybrid_optimizer
        if not (self.swap_optimizer or (hybrid.enable and hybrid.offload_fraction == 1.0)):
            raise ValueError(
                "grad_offload=True needs an optimizer that steps from host gradients: swap_optimizer=True, or "
                "hybrid_optimizer.enable=True with hybrid_optimizer.offload_fraction=1.0 "
                f"(got swap_optimizer={self.swap_optimizer}, hybrid_optimizer.enable={hybrid.enable}, "
                f"offload_fraction={hybrid.offload_fraction})"
            )

    def _check_nvme(self) -> None:
        if self.nvme_offload.path is None:
            raise ValueError("nvme_offload.enable=True needs nvme_offload.path, a directory on a local NVMe drive")
        if not (self.swap_optimizer or self.hybrid_optimizer.enable):
            raise ValueError(
                "nvme_offload.enable=True holds the offloaded optimizer states; it needs swap_optimizer=True or "
                "hybrid_optimizer.enable=True"
            )

    def checkpointed_layers(self) -> int:
        """`int(num_layers * model.checkpoint)`: InternEvo's count of blocks under activation checkpointing."""
        return int(block_count(self.model) * self.model.checkpoint)

    def fingerprint(self) -> str:
        """A short hash of the resolved config, recorded in metrics and checkpoints."""
        return hashlib.sha256(json.dumps(self.model_dump(), sort_keys=True).encode()).hexdigest()[:12]
