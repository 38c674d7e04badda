"""Where a run starts, decided before anything is built or written: a resume of this run (its newest intact
checkpoint), a checkpoint or another trainer's weights the config names, or a fresh start into a folder that
holds no earlier run's checkpoints. Reads checkpoints through `engine/checkpoint.py`; writes nothing."""

from dataclasses import dataclass
from pathlib import Path

from internlm_offload.config import ConfigError, RunConfig
from internlm_offload.engine.checkpoint import (
    latest_checkpoint,
    newest_intact_checkpoint,
    read_train_state,
    require_intact,
    resolve_checkpoint_path,
)
from internlm_offload.engine.runtime import RunContext
from internlm_offload.errors import CheckpointError
from internlm_offload.log import get_logger
from internlm_offload.weights.sources import WeightsSource, foreign_source

logger = get_logger(__name__)


@dataclass(frozen=True)
class StartPlan:
    """Where a run writes its checkpoints and what it loads before its first step."""

    folder: Path  # this run's checkpoint folder
    resume_from: Path | None = None  # a full resume: model, optimizer, schedule, data position, RNG
    weights_from: WeightsSource | None = None  # weights only: a new run from step 1 (a LoRA resume: its base)

    @property
    def fresh(self) -> bool:
        """Not a resume: the run starts at step 1 (and a new metrics file)."""
        return self.resume_from is None


def plan_start(cfg: RunConfig, work_dir: Path, *, resume: bool, ctx: RunContext | None = None) -> StartPlan:
    """Find the checkpoints a run starts from, before anything is built or written; `resume`: --resume.
    `ctx`: the ranks share the reading when checkpoints are verified (every rank calls this).

    A resume of this run takes its newest intact checkpoint, past damaged ones. Refuses, in this order: a
    checkpoint that is missing, incomplete or damaged, a full resume with other numerics (dtype, master
    weights), and a fresh run whose checkpoint folder already holds an earlier run's.
    """
    folder = checkpoint_folder(cfg, work_dir)
    resume_from = find_resume_checkpoint(cfg, folder, resume=resume or cfg.ckpt.auto_resume, ctx=ctx)
    if resume_from is not None:
        check_same_precision(cfg, resume_from)
        # a LoRA checkpoint holds the adapters only: the base is loaded again from where the config names it
        base = find_weights_source(cfg) if cfg.model.lora is not None else None
        return StartPlan(folder, resume_from=resume_from, weights_from=base)
    weights_from = find_weights_source(cfg)
    if weights_from is not None and weights_from.kind == "dcp":
        require_intact(weights_from.path, ctx)
    refuse_to_clobber(folder)
    return StartPlan(folder, weights_from=weights_from)


def checkpoint_folder(cfg: RunConfig, work_dir: Path) -> Path:
    """`ckpt.save_ckpt_folder`, or `<work_dir>/checkpoints`."""
    return Path(cfg.ckpt.save_ckpt_folder) if cfg.ckpt.save_ckpt_folder else work_dir / "checkpoints"


def find_resume_checkpoint(cfg: RunConfig, folder: Path, *, resume: bool, ctx: RunContext | None = None) -> Path | None:
    """A resume of this run (--resume / auto_resume: the newest intact checkpoint in its `folder`) wins, then
    `ckpt.load_ckpt_folder` or `ckpt.load_ckpt_info` with `content=("all",)` (refused when damaged)."""
    newest = newest_intact_checkpoint(folder, ctx) if resume else None
    if newest is not None:
        return newest
    info = cfg.ckpt.load_ckpt_info
    if info is not None and info.content == ["all"]:
        foreign_source(info, cfg.model)  # refuses another trainer's weights: they do not resume
        return require_intact(resolve_checkpoint_path(Path(info.path)), ctx)
    if cfg.ckpt.load_ckpt_folder:
        return require_intact(resolve_checkpoint_path(Path(cfg.ckpt.load_ckpt_folder)), ctx)
    if resume:
        logger.warning("--resume: no checkpoint in %s, starting from scratch", folder)
    return None


def check_same_precision(cfg: RunConfig, path: Path) -> None:
    """A full resume continues the same numerics: refuse another dtype or master-weight setting."""
    saved = read_train_state(path)["config"]
    mine = (cfg.model.dtype, cfg.mixed_precision.master_weights)
    theirs = (saved["model"]["dtype"], saved.get("mixed_precision", {}).get("master_weights", True))
    if mine != theirs:
        raise CheckpointError(
            f"checkpoint {path} was written with model.dtype={theirs[0]} (master_weights={theirs[1]}); this run "
            f"has model.dtype={mine[0]} (master_weights={mine[1]}). Resume with the checkpoint's settings, or start "
            'a new run from its weights: ckpt.load_ckpt_info=dict(path=..., content=("model",))'
        )


def find_weights_source(cfg: RunConfig) -> WeightsSource | None:
    """`ckpt.load_ckpt_info` with `content=("model",)`: the weights that start this run, this trainer's
    checkpoint or another trainer's folder (checked against the model config before anything is built)."""
    info = cfg.ckpt.load_ckpt_info
    if info is None or info.content != ["model"]:
        return None
    foreign = foreign_source(info, cfg.model)
    if foreign is not None and cfg.parallel.pipeline.size > 1:
        raise ConfigError(
            f"ckpt.load_ckpt_info.path={info.path!r}: another trainer's weights ({foreign.kind}) do not load into a "
            "pipeline's stages yet; load them without a pipeline and save, then load that checkpoint"
        )
    if foreign is not None:
        return foreign
    return WeightsSource(resolve_checkpoint_path(Path(info.path)), "dcp")


def check_named_weights(cfg: RunConfig) -> None:
    """Refuse the weights `ckpt.load_ckpt_info` names when the run would refuse them at its start (another trainer's
    folder of an architecture or shape the configured model is not, or that a pipeline cannot load), before
    anything is traced for the configured model: a plan or a preflight of it would describe a model that never
    trains. The start's own checks (`find_weights_source`, `foreign_source`), nothing else."""
    info = cfg.ckpt.load_ckpt_info
    if info is None:
        return
    if info.content == ["model"]:
        find_weights_source(cfg)
    else:
        foreign_source(info, cfg.model)


def refuse_to_clobber(folder: Path) -> None:
    """A fresh run must not mix its checkpoints with an earlier run's."""
    latest = latest_checkpoint(folder)
    if latest is not None:
        raise CheckpointError(
            f"{folder} already holds checkpoints (latest: {latest.name}); "
            "pass --resume to continue that run, or choose another --work-dir"
        )
