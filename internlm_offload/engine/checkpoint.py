"""Checkpoints: model and optimizer through torch.distributed.checkpoint (DCP), plus the train state.

Layout of one checkpoint, `<folder>/step_00000020/`:
- DCP files (`.metadata`, `*.distcp`): model and optimizer state, resharded on load, so a checkpoint
  written under FSDP2 loads under DDP or one process and back;
- `train_state.pt`: step, tokens, sampler position, LR scheduler, the resolved config (plain types,
  loads with `weights_only=True`);
- `rng/rank_<r>.pt`: each rank's RNG states;
- `manifest.json`, written last: step, world size, config fingerprint and the model's parameter shapes.

A checkpoint is written into a hidden temporary folder and renamed into place only when complete,
and the `latest` pointer moves after that; a crash mid-save never leaves a half checkpoint as
latest, and an existing checkpoint is never overwritten.
"""

import json
import os
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from internlm_offload.config import RunConfig
from internlm_offload.engine.checkpoint_reader import UnsafeCheckpointError, read_checkpoint
from internlm_offload.engine.runtime import RunContext, barrier
from internlm_offload.log import get_logger

logger = get_logger(__name__)

# DCP warns on every call in a single process (no process group); that is a supported mode here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.pt"
LATEST = "latest"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or was saved for another model."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def model_signature(model_state: dict[str, Any]) -> dict[str, list[int]]:
    """Parameter name → global shape; identifies the model a checkpoint belongs to."""
    return {name: list(t.shape) for name, t in sorted(model_state.items()) if isinstance(t, torch.Tensor)}


class CheckpointManager:
    """Saves and loads checkpoints in one folder; every rank calls `save`/`load` collectively."""

    def __init__(self, folder: Path, ctx: RunContext, *, keep_last: int = 2) -> None:
        self.folder = Path(folder)
        self.ctx = ctx
        self.keep_last = keep_last

    # ------------------------------------------------------------------ save

    def save(
        self, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any]
    ) -> Path:
        final = self.folder / step_dir_name(step)
        if final.exists():
            logger.warning("checkpoint %s already exists; not overwriting it", final)
            return final
        tmp = self.folder / f".tmp-{step_dir_name(step)}"
        if self.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
            tmp.mkdir(parents=True)
        barrier(self.ctx)
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
        self._save_rng(tmp)
        barrier(self.ctx)
        if self.ctx.is_main:
            torch.save(train_state, tmp / TRAIN_STATE)
            manifest = {
                "format": FORMAT_VERSION,
                "step": step,
                "world_size": self.ctx.world_size,
                "config_fingerprint": train_state.get("config_fingerprint"),
                "torch_version": torch.__version__,
                "model": model_signature(model_state),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            os.replace(tmp, final)
            self._point_latest(final)
            self._prune()
        barrier(self.ctx)
        logger.info("Saved checkpoint %s", final)
        return final

    def _save_rng(self, folder: Path) -> None:
        rng_dir = folder / "rng"
        rng_dir.mkdir(exist_ok=True)
        state = {
            "python": random.getstate(),
            "torch": torch.get_rng_state(),
            "device": self.ctx.accelerator.rng_state(),
        }
        torch.save(state, rng_dir / f"rank_{self.ctx.rank}.pt")

    def _point_latest(self, final: Path) -> None:
        tmp_pointer = self.folder / f".{LATEST}.tmp"
        tmp_pointer.write_text(final.name + "\n")
        os.replace(tmp_pointer, self.folder / LATEST)

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        for old in complete_checkpoints(self.folder)[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ load

    def load(self, path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Load model, optimizer and RNG states in place; return the train state."""
        path = resolve_checkpoint_path(Path(path))
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        manifest = read_into(path, state)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self._load_rng(path, saved_world_size=manifest["world_size"])
        train_state = read_train_state(path)
        logger.info("Loaded checkpoint %s (step %d)", path, manifest["step"])
        return train_state

    def load_model(self, path: Path, *, model: nn.Module) -> Path:
        """Load only the weights of a checkpoint (any world size and parallel mode: DCP reshards them)."""
        path = resolve_checkpoint_path(Path(path))
        state = {"model": get_model_state_dict(model)}
        manifest = read_into(path, state)
        set_model_state_dict(model, state["model"])
        logger.info("Loaded the weights of %s (step %d); starting a new run at step 1", path, manifest["step"])
        return path

    def _load_rng(self, path: Path, *, saved_world_size: int) -> None:
        rng_file = path / "rng" / f"rank_{self.ctx.rank}.pt"
        if saved_world_size != self.ctx.world_size or not rng_file.is_file():
            logger.warning(
                "RNG states not restored (saved on %d ranks, running on %d)", saved_world_size, self.ctx.world_size
            )
            return
        state = torch.load(rng_file, weights_only=True)
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        self.ctx.accelerator.set_rng_state(state["device"])


def complete_checkpoints(folder: Path) -> list[Path]:
    """Finished checkpoints (those with a manifest), oldest first."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("step_*") if p.is_dir() and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint; the `latest` pointer is a hint, the manifests decide."""
    pointer = folder / LATEST
    if pointer.is_file():
        candidate = folder / pointer.read_text().strip()
        if (candidate / MANIFEST).is_file():
            return candidate
    complete = complete_checkpoints(folder)
    return complete[-1] if complete else None


def resolve_checkpoint_path(path: Path) -> Path:
    """Accept a `step_*` folder or a checkpoint folder (then its latest checkpoint)."""
    if (path / MANIFEST).is_file():
        return path
    if path.is_dir():
        latest = latest_checkpoint(path)
        if latest is not None:
            return latest
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST}) and holds none")


def read_into(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Refuse a checkpoint of another model, then fill `state` (its "model" entry and any others) from it
    in place, resharded by DCP; returns the manifest."""
    manifest = read_manifest(path)
    check_signature(path, manifest["model"], model_signature(state["model"]))
    try:
        read_checkpoint(path, state)
    except UnsafeCheckpointError as exc:
        raise CheckpointError(str(exc)) from None
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} cannot be read: {_first_cause(exc)}") from exc
    return manifest


def read_train_state(path: Path) -> dict[str, Any]:
    """A checkpoint's train state (step, sampler, schedule, the resolved config); plain types only."""
    try:
        return torch.load(path / TRAIN_STATE, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path}: {TRAIN_STATE} is unreadable: {exc}") from exc


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({exc})") from exc
    if manifest.get("format") != FORMAT_VERSION or "model" not in manifest:
        raise CheckpointError(f"checkpoint {path}: unknown format {manifest.get('format')!r}")
    return manifest


def _first_cause(exc: BaseException) -> str:
    """DCP wraps per-rank failures; name the underlying error in one short line."""
    if isinstance(exc, CheckpointException) and exc.failures:
        failure = next(iter(exc.failures.values()))
        exc = failure[0] if isinstance(failure, tuple) else failure  # (exception, stack summary)
    text = " ".join(f"{type(exc).__name__} {exc}".split())
    return text[:300]


def check_signature(path: Path, saved: dict[str, list[int]], current: dict[str, list[int]]) -> None:
    """Refuse a checkpoint of another model, naming the first parameter that differs."""
    for name in sorted(set(saved) | set(current)):
        if name not in current:
            raise CheckpointError(
                f"checkpoint {path} was saved for another model: it has {name!r}, this model does not"
            )
        if name not in saved:
            raise CheckpointError(f"checkpoint {path} was saved for another model: it lacks {name!r}")
        if saved[name] != current[name]:
            raise CheckpointError(
                f"checkpoint {path} was saved for another model: {name} has shape {saved[name]}, "
                f"this model has {current[name]}"
            )


# ----------------------------------------------------------------------------- where a run starts


@dataclass(frozen=True)
class StartPlan:
    """Where a run writes its checkpoints and what it loads before its first step."""

    folder: Path  # this run's checkpoint folder
    resume_from: Path | None = None  # a full resume: model, optimizer, schedule, data position, RNG
    weights_from: Path | None = None  # weights only: a new run from step 1

    @property
    def fresh(self) -> bool:
        """Not a resume: the run starts at step 1 (and a new metrics file)."""
        return self.resume_from is None


def plan_start(cfg: RunConfig, work_dir: Path, *, resume: bool) -> StartPlan:
    """Find the checkpoints a run starts from, before anything is built or written; `resume`: --resume.

    Refuses, in this order: a checkpoint that is missing or incomplete, a full resume with other numerics
    (dtype, master weights), and a fresh run whose checkpoint folder already holds an earlier run's.
    """
    folder = checkpoint_folder(cfg, work_dir)
    resume_from = find_resume_checkpoint(cfg, folder, resume=resume or cfg.ckpt.auto_resume)
    if resume_from is not None:
        check_same_precision(cfg, resume_from)
        return StartPlan(folder, resume_from=resume_from)
    weights_from = find_weights_checkpoint(cfg)
    refuse_to_clobber(folder)
    return StartPlan(folder, weights_from=weights_from)


def checkpoint_folder(cfg: RunConfig, work_dir: Path) -> Path:
    """`ckpt.save_ckpt_folder`, or `<work_dir>/checkpoints`."""
    return Path(cfg.ckpt.save_ckpt_folder) if cfg.ckpt.save_ckpt_folder else work_dir / "checkpoints"


def find_resume_checkpoint(cfg: RunConfig, folder: Path, *, resume: bool) -> Path | None:
    """A resume of this run (--resume / auto_resume: the latest in its checkpoint `folder`) wins, then
    `ckpt.load_ckpt_folder` or `ckpt.load_ckpt_info` with `content=("all",)`."""
    latest = latest_checkpoint(folder) if resume else None
    if latest is not None:
        return latest
    info = cfg.ckpt.load_ckpt_info
    if info is not None and info.content == ["all"]:
        return resolve_checkpoint_path(Path(info.path))
    if cfg.ckpt.load_ckpt_folder:
        return resolve_checkpoint_path(Path(cfg.ckpt.load_ckpt_folder))
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


def find_weights_checkpoint(cfg: RunConfig) -> Path | None:
    """`ckpt.load_ckpt_info` with `content=("model",)`: the checkpoint whose weights start this run."""
    info = cfg.ckpt.load_ckpt_info
    if info is None or info.content != ["model"]:
        return None
    return resolve_checkpoint_path(Path(info.path))


def refuse_to_clobber(folder: Path) -> None:
    """A fresh run must not mix its checkpoints with an earlier run's."""
    latest = latest_checkpoint(folder)
    if latest is not None:
        raise CheckpointError(
            f"{folder} already holds checkpoints (latest: {latest.name}); "
            "pass --resume to continue that run, or choose another --work-dir"
        )
