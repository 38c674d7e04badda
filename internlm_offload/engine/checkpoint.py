"""Checkpoints: model and optimizer through torch.distributed.checkpoint (DCP), plus the train state.

Layout of one checkpoint, `<folder>/step_00000020/`:
- DCP files (`.metadata`, `*.distcp`): model and optimizer state, resharded on load, so a checkpoint
  written under FSDP2 loads under DDP or one process and back;
- `train_state.pt`: step, tokens, sampler position, LR scheduler, the resolved config (plain types,
  loads with `weights_only=True`);
- `rng/rank_<r>.pt`: each rank's RNG states;
- `manifest.json`, written last: step, world size and parallel layout, config fingerprint and the model's parameter
  shapes.

Parameters and optimizer states are stored whole, by name: a checkpoint continues on another layout (see
engine/checkpoint_layout.py), the optimizer's param groups regrouped by parameter name.

A checkpoint is written into a hidden temporary folder and renamed into place only when complete,
and the `latest` pointer moves after that; a crash mid-save never leaves a half checkpoint as
latest, and an existing checkpoint is never overwritten.
"""

import errno
import functools
import json
import os
import random
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.utils._pytree import tree_leaves

from internlm_offload.engine.checkpoint_integrity import (
    MANIFEST,
    WHOLE,
    checkpoint_files,
    damaged_files,
    folder_bytes,
    free_bytes,
    record_files,
)
from internlm_offload.engine.checkpoint_layout import (
    describe_layout,
    describe_move,
    run_layout,
    same_layout,
    saved_layout,
)
from internlm_offload.engine.checkpoint_reader import SafeFileSystemReader, UnsafeCheckpointError, read_checkpoint
from internlm_offload.engine.runtime import RunContext, all_gather_object, barrier
from internlm_offload.errors import CheckpointError, CheckpointWriteError
from internlm_offload.log import get_logger
from internlm_offload.model.lora import base_keys, has_adapters
from internlm_offload.config.sizes import human_bytes

logger = get_logger(__name__)

# DCP warns on every call in a single process (no process group); that is a supported mode here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

TRAIN_STATE = "train_state.pt"
LATEST = "latest"
DAMAGED = "damaged"  # where a damaged checkpoint goes when its step is written again; nothing is deleted
FORMAT_VERSION = 1
# A pipeline's checkpoint keeps its optimizer state flat, by parameter name (`state.layers.5.w.exp_avg`,
# `param_groups.layers.5.w.lr`): each stage writes its own names, and any layout reads the ones it holds.
FLAT_OPTIM = "optim_flat"


class CheckpointSpaceError(OSError):
    """Raised before writing when the file system cannot hold the checkpoint."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def state_bytes(state: Any) -> int:
    """Bytes of every tensor in a (nested) state dict, at their global size (a DTensor counts whole once)."""
    leaves = tree_leaves(state)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def unused_path(path: Path) -> Path:
    """`path`, or `path.1`, `path.2`, ... : the first that does not exist."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def describe_write_failure(exc: BaseException, folder: Path, needed: int) -> str:
    """One line for why a checkpoint write failed; a full file system says how full."""
    if isinstance(exc, CheckpointSpaceError):
        return str(exc)
    cause = _root_os_error(exc)
    free = free_bytes(folder)
    if (cause is not None and cause.errno == errno.ENOSPC) or free < needed:
        return f"no space left on device: {human_bytes(free)} free, the checkpoint needs about {human_bytes(needed)}"
    if cause is not None and cause.errno is not None:
        where = f": {cause.filename}" if cause.filename else ""
        return f"{os.strerror(cause.errno).lower()}{where}"
    return _first_cause(exc)


def dcp_failure(exc: BaseException) -> tuple[int, BaseException] | None:
    """The lowest rank's failure a `CheckpointException` carries (DCP collects every rank's), else None."""
    if not (isinstance(exc, CheckpointException) and exc.failures):
        return None
    rank = min(exc.failures)
    failure = exc.failures[rank]  # an exception, or (exception, stack summary)
    return rank, failure[0] if isinstance(failure, tuple) else failure


def failing_rank(exc: BaseException, rank: int) -> int:
    """The rank a failure happened on: DCP raises one rank's write failure on every rank and names it."""
    failure = dcp_failure(exc)
    return failure[0] if failure is not None else rank


def _root_os_error(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`: itself, its cause chain, or the first failure DCP collected."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError):
            return exc
        failure = dcp_failure(exc)
        exc = failure[1] if failure is not None else exc.__cause__ or exc.__context__
    return None


def model_signature(model_state: dict[str, Any]) -> dict[str, list[int]]:
    """Parameter name → global shape; identifies the model a checkpoint belongs to."""
    return {name: list(t.shape) for name, t in sorted(model_state.items()) if isinstance(t, torch.Tensor)}


class CheckpointManager:
    """Saves and loads checkpoints in one folder; every rank calls `save`/`load` collectively."""

    def __init__(self, folder: Path, ctx: RunContext, *, keep_last: int = 2, skip_frozen: bool = False) -> None:
        """`skip_frozen`: hold only the parameters that train (LoRA's adapters); the frozen base comes from where
        the run's config names it (its seed, `model.hf_path` or `ckpt.load_ckpt_info`) on every start."""
        self.folder = Path(folder)
        self.ctx = ctx
        self.keep_last = keep_last
        self._skip_frozen = skip_frozen

    # ------------------------------------------------------------------ save

    def save(
        self, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any]
    ) -> Path:
        """Write the checkpoint of `step` (all ranks). A failure on any rank raises `CheckpointWriteError`
        on every rank after the partial folder is removed; `latest` and earlier checkpoints stay as they were."""
        final = self.folder / step_dir_name(step)
        if self._keep_existing(final):
            return final
        tmp = self.folder / f".tmp-{step_dir_name(step)}"
        flat = self.ctx.pipeline_size > 1
        model_state, optim_state = get_state_dict(model, optimizer, options=self._state_options(flat))
        needed = state_bytes(model_state) + state_bytes(optim_state)
        attempt = functools.partial(self._attempt, final=final, tmp=tmp, needed=needed)
        attempt(lambda: self._require_space(needed), main_only=True)
        attempt(lambda: self._make_tmp(tmp), main_only=True)
        attempt(lambda: self._write_states(tmp, {"model": model_state, "optim": optim_state}, train_state))
        share = (self.ctx.rank, self.ctx.world_size)
        records: dict[str, Any] = {}
        for part in attempt(lambda: record_files(tmp, checkpoint_files(tmp), share), gather=True):
            records.update(part or {})
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "world_size": self.ctx.world_size,
            "layout": run_layout(self.ctx),
            "config_fingerprint": train_state.get("config_fingerprint"),
            "torch_version": torch.__version__,
            "model": self._signature(model_state),
            "files": dict(sorted(records.items())),
        }
        if flat:
            manifest[FLAT_OPTIM] = True
        attempt(lambda: self._publish(tmp, final, manifest), main_only=True)
        logger.info("Saved checkpoint %s", final)
        return final

    def check_space(self, needed: int) -> None:
        """Refuse to start a run whose checkpoints cannot fit (`CheckpointWriteError`, every rank)."""
        problem = self._space_problem(needed) if self.ctx.is_main else None
        problems = [p for p in all_gather_object(self.ctx, problem) if p]
        if problems:
            raise CheckpointWriteError(
                f"cannot save checkpoints in {self.folder}: {problems[0]}; free space there or set "
                "ckpt.save_ckpt_folder to another file system"
            )

    def expected_bytes(self, module: nn.Module) -> int:
        """The next checkpoint's size: the last one's, or before any the parameters `module` holds plus
        AdamW's two moments of the same size (an estimate; the optimizer makes its states at its first step)."""
        last = latest_checkpoint(self.folder)
        if last is not None:
            return folder_bytes(last)
        return 3 * state_bytes(list(module.parameters()))

    def _space_problem(self, needed: int) -> str | None:
        free = free_bytes(self.folder)
        if free >= needed:
            return None
        return f"not enough space: {human_bytes(free)} free, a checkpoint needs about {human_bytes(needed)}"

    def _require_space(self, needed: int) -> None:
        problem = self._space_problem(needed)
        if problem is not None:
            raise CheckpointSpaceError(problem)

    def _attempt(
        self,
        action: Callable[[], Any],
        *,
        final: Path,
        tmp: Path,
        needed: int,
        main_only: bool = False,
        gather: bool = False,
    ) -> list[Any]:
        """Run one stage of a save on every rank (or on rank 0), then agree: when any rank failed, every rank
        raises `CheckpointWriteError` naming the first failure. Returns each rank's result when `gather`."""
        result, problem = None, None
        if self.ctx.is_main or not main_only:
            try:
                result = action()
            # Any failure, torch.save's RuntimeError on a full disk included: every rank must reach the agreement.
            except (Exception, CheckpointException) as exc:  # noqa: BLE001  (CheckpointException: a BaseException)
                problem = (failing_rank(exc, self.ctx.rank), describe_write_failure(exc, self.folder, needed))
        outcomes = all_gather_object(self.ctx, (result if gather else None, problem))
        failed = sorted(p for _, p in outcomes if p is not None)
        if failed:
            self._abandon(final, tmp, failed)
        return [r for r, _ in outcomes]

    def _abandon(self, final: Path, tmp: Path, failed: list[tuple[int, str]]) -> None:
        """Remove the partial folder and raise the first failure (lowest rank) on every rank."""
        if self.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier(self.ctx)
        rank, problem = failed[0]
        where = f" on rank {rank}" if self.ctx.world_size > 1 else ""
        last = latest_checkpoint(self.folder)
        kept = f"the last good checkpoint, {last}, is intact" if last is not None else "no earlier checkpoint exists"
        raise CheckpointWriteError(
            f"checkpoint {final} could not be written{where}: {problem}; {kept} and the partial folder was removed"
        )

    def _keep_existing(self, final: Path) -> bool:
        """A step folder that already exists is kept as it is, unless it is damaged (a resume fell back past
        it): then it moves to `damaged/` and the step is written again. Never deletes."""
        if self.ctx.is_main and final.exists():
            problems = checkpoint_problems(final)
            if problems:
                aside = unused_path(self.folder / DAMAGED / final.name)
                aside.parent.mkdir(exist_ok=True)
                os.replace(final, aside)
                logger.warning("%s is damaged (%s); moved to %s and writing it again", final, problems[0], aside)
        barrier(self.ctx)
        if final.exists():
            logger.warning("checkpoint %s already exists; not overwriting it", final)
            return True
        return False

    def _make_tmp(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        tmp.mkdir(parents=True)

    def _write_states(self, tmp: Path, state: dict[str, Any], train_state: dict[str, Any]) -> None:
        dcp.save(state, checkpoint_id=str(tmp))  # collective: a failure on one rank is raised on all
        self._save_rng(tmp)
        if self.ctx.is_main:
            torch.save(train_state, tmp / TRAIN_STATE)

    def _publish(self, tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
        """The manifest last, then the rename, then `latest`: a crash before any of them leaves only a temp folder."""
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        pointer = self.folder / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")  # written before the rename, so a full disk fails before it
        os.replace(tmp, final)
        os.replace(pointer, self.folder / LATEST)
        self._prune()

    def _save_rng(self, folder: Path) -> None:
        rng_dir = folder / "rng"
        rng_dir.mkdir(exist_ok=True)
        state = {
            "python": random.getstate(),
            "torch": torch.get_rng_state(),
            "device": self.ctx.accelerator.rng_state(),
        }
        torch.save(state, rng_dir / f"rank_{self.ctx.rank}.pt")

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        for old in complete_checkpoints(self.folder)[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ load

    def load(self, path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Load model, optimizer and RNG states in place; return the train state."""
        path = resolve_checkpoint_path(Path(path))
        manifest, reader = read_manifest(path), open_checkpoint(path)
        saved, current = saved_layout(manifest), run_layout(self.ctx)
        move = describe_move(saved, current)
        if not same_layout(saved, current):
            logger.info("Checkpoint %s: %s; parameters and optimizer states regroup by name", path.name, move)
        # a nested optimizer state (saved without a pipeline) splits into stages too: each rank takes its names
        flat = manifest.get(FLAT_OPTIM, False)
        model_state, optim_state = get_state_dict(model, optimizer, options=self._state_options(flat))
        own_groups = None
        if not flat:  # the nested form's groups follow the layout: read them all, regroup them below
            own_groups = [dict(group, params=list(group["params"])) for group in optim_state["param_groups"]]
            optim_state["param_groups"] = saved_param_groups(reader.read_metadata())  # DCP fills a template only
        state = {"model": model_state, "optim": optim_state}
        read_into(path, state, signature=self._signature(model_state), manifest=manifest, reader=reader)
        if own_groups is not None:
            state["optim"]["param_groups"] = regroup_param_groups(
                state["optim"]["param_groups"], own_groups, path, move=move
            )
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self._state_options(flat, loading=True),
        )
        self._load_rng(path, saved=saved)
        train_state = read_train_state(path)
        logger.info("Loaded checkpoint %s (step %d)", path, manifest["step"])
        return train_state

    def load_model(self, path: Path, *, model: nn.Module) -> Path:
        """Load only the weights of a checkpoint (any world size and parallel mode: DCP reshards them)."""
        path = resolve_checkpoint_path(Path(path))
        own = get_model_state_dict(model)
        keys = base_keys(own) if has_adapters(model) else {key: key for key in own}  # LoRA: the base's names
        state = {"model": {name: own[key] for name, key in keys.items()}}
        manifest = read_into(path, state, signature=self._signature(state["model"]))
        loaded = {keys[name]: tensor for name, tensor in state["model"].items()}
        set_model_state_dict(model, loaded, options=StateDictOptions(strict=len(keys) == len(own)))
        logger.info("Loaded the weights of %s (step %d); starting a new run at step 1", path, manifest["step"])
        return path

    def _state_options(self, flat: bool, *, loading: bool = False) -> StateDictOptions:
        """`flat`: the optimizer state keyed by parameter name (a pipeline's stages: `FLAT_OPTIM`). Loading
        with the frozen base skipped, its keys are absent by design; every trainable one is read (the template)."""
        return StateDictOptions(
            flatten_optimizer_state_dict=flat,
            ignore_frozen_params=self._skip_frozen,
            strict=not (loading and self._skip_frozen),
        )

    def _signature(self, model_state: dict[str, Any]) -> dict[str, list[int]]:
        """The whole model's signature: under a pipeline each rank holds its stages' parameters only."""
        if self.ctx.pipeline_size == 1:
            return model_signature(model_state)
        whole: dict[str, list[int]] = {}
        for part in all_gather_object(self.ctx, model_signature(model_state)):
            whole.update(part)
        return dict(sorted(whole.items()))

    def _load_rng(self, path: Path, *, saved: dict[str, int]) -> None:
        """Each rank's RNG states, where this run has the ranks that saved them (its world size)."""
        rng_file = path / "rng" / f"rank_{self.ctx.rank}.pt"
        if saved["world_size"] != self.ctx.world_size or not rng_file.is_file():
            here = describe_layout(run_layout(self.ctx))
            logger.warning("RNG states not restored (saved on %s, running on %s)", describe_layout(saved), here)
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


def checkpoint_problems(path: Path, ctx: RunContext | None = None) -> list[str]:
    """What is damaged in one checkpoint (empty: intact): its files against the manifest's sizes and SHA-256.
    With `ctx`, every rank checks a share of the files and all ranks get the whole answer."""
    try:
        listed = read_manifest(path).get("files")
    except CheckpointError as exc:
        return [str(exc)]
    if listed is None:  # written before manifests listed files: nothing to check against
        return []
    share = (ctx.rank, ctx.world_size) if ctx is not None else WHOLE
    mine = damaged_files(path, listed, share)
    gathered = all_gather_object(ctx, mine) if ctx is not None else [mine]
    return sorted(p for part in gathered for p in part)


def newest_intact_checkpoint(folder: Path, ctx: RunContext | None = None) -> Path | None:
    """The newest checkpoint in `folder` whose files match its manifest; a damaged one is named in one
    warning and skipped (not deleted). None when the folder holds none; `CheckpointError` when all are damaged."""
    skipped: list[str] = []
    for path in reversed(complete_checkpoints(folder)):
        problems = checkpoint_problems(path, ctx)
        if not problems:
            if skipped:
                logger.warning(
                    "Resume: %s; resuming from %s, the newest intact checkpoint (nothing was deleted)",
                    "; ".join(skipped),
                    path.name,
                )
            return path
        more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
        skipped.append(f"{path.name} is damaged ({problems[0]}{more})")
    if skipped:
        raise CheckpointError(f"no intact checkpoint in {folder}: {'; '.join(skipped)}")
    return None


def require_intact(path: Path, ctx: RunContext | None = None) -> Path:
    """A checkpoint the config names must be whole: refuse it, naming the damage, when it is not."""
    problems = checkpoint_problems(path, ctx)
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems)}")
    return path


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


def read_into(
    path: Path,
    state: dict[str, Any],
    *,
    signature: dict[str, list[int]] | None = None,
    manifest: dict[str, Any] | None = None,
    reader: SafeFileSystemReader | None = None,
) -> dict[str, Any]:
    """Refuse a checkpoint of another model (`signature`: the whole model's, by default `state`'s), then fill
    `state` (its "model" entry and any others) from it in place, resharded by DCP; returns the manifest.
    `manifest` / `reader`: the checkpoint's, where the caller has read them already."""
    manifest = manifest or read_manifest(path)
    check_signature(path, manifest["model"], signature or model_signature(state["model"]))
    reader = reader or open_checkpoint(path)
    try:
        read_checkpoint(path, state, reader=reader)
    except UnsafeCheckpointError as exc:
        raise CheckpointError(str(exc)) from None
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} cannot be read: {_first_cause(exc)}") from exc
    return manifest


def open_checkpoint(path: Path) -> SafeFileSystemReader:
    """A reader on the checkpoint with its DCP metadata read (once, safely); a refusal is one line."""
    reader = SafeFileSystemReader(str(path))
    try:
        reader.read_metadata()
    except UnsafeCheckpointError as exc:
        raise CheckpointError(str(exc)) from None
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {_first_cause(exc)}") from exc
    return reader


def saved_param_groups(metadata: Metadata) -> list[dict[str, Any]]:
    """A template of the optimizer param groups a checkpoint holds, each key None until DCP reads it."""
    prefix = "optim.param_groups."
    groups: dict[int, dict[str, Any]] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith(prefix):
            index, _, name = key[len(prefix) :].partition(".")
            groups.setdefault(int(index), {})[name] = None
    return [groups[index] for index in sorted(groups)]


def regroup_param_groups(
    saved: list[dict[str, Any]], own: list[dict[str, Any]], path: Path, *, move: str = ""
) -> list[dict[str, Any]]:
    """The saved optimizer's hyperparameters in this optimizer's grouping (each group's "params" are FQNs).

    The groups follow the layout (`optim.param_groups`: one per DTensor mesh, and a pipeline rank's hold its
    stages' parameters only), so a checkpoint moving between layouts (expert parallel of another size or none,
    another pipeline size) meets other groups, which DCP does not map: each group here takes the hyperparameters
    its parameters were saved with. On the saving layout this returns the saved groups' values. `move`: the two
    layouts (`describe_move`), for the refusals.
    """
    where = f"checkpoint {path}" + (f" ({move})" if move else "")
    saved_by_name = {name: group for group in saved for name in group["params"]}
    regrouped = []
    for group in own:
        missing = [name for name in group["params"] if name not in saved_by_name]
        if missing:
            raise CheckpointError(f"{where}: no optimizer hyperparameters saved for {missing[0]}")
        sources = {id(saved_by_name[name]): saved_by_name[name] for name in group["params"]}
        settings = [{key: value for key, value in source.items() if key != "params"} for source in sources.values()]
        if any(setting != settings[0] for setting in settings):
            raise CheckpointError(
                f"{where}: the parameters of one optimizer group here were saved with different "
                f"hyperparameters ({group['params'][0]} and others); resume on the layout that saved it"
            )
        regrouped.append({**settings[0], "params": group["params"]})
    return regrouped


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
    failure = dcp_failure(exc)
    if failure is not None:
        exc = failure[1]
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
