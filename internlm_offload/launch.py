"""The command line entry point behind `train.py`: parse, validate, build (with the builder `train.py`
hands in), resume, train.

Exit codes: 0 done; 2 bad input (config, data, checkpoint): one `error: ...` line on stderr, before
anything is written to the work dir; 3 the run diverged (too many consecutive non-finite steps): one
`error: ...` line, no checkpoint of the bad state; 4 a checkpoint could not be written (no space, no
permission, an I/O error, on any rank), or the checkpoint folder cannot hold one at start: one `error: ...`
line naming the cause and the last good checkpoint, no partial folder left, `latest` untouched; 130 a
second Ctrl-C (no checkpoint, no traceback).
A first SIGTERM or Ctrl-C finishes the current step, writes a checkpoint and exits 0: `--resume`
continues the same curve bitwise.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

# Only light imports here: a bad config and --print-config are answered before torch is imported
# (about 1 s instead of 5); the runtime, the device and the checkpoint code load once the config is valid.
from internlm_offload.config import (
    ConfigError,
    RunConfig,
    chunked_loss,
    experts_over_tensor,
    load_config_file,
    resolve_config,
)
from internlm_offload.config.file import add_cfg_options
from internlm_offload.errors import CheckpointError, CheckpointWriteError, DataError, TrainingDiverged
from internlm_offload.family import block_kinds, capabilities, with_blocks
from internlm_offload.log import get_logger, setup_logging
from internlm_offload.registry import UnknownTypeError
from internlm_offload.torchrun_env import env_local_rank, env_local_world_size, env_world_size, launched_by_torchrun

if TYPE_CHECKING:
    from internlm_offload.device import Accelerator
    from internlm_offload.engine.runtime import RunContext
    from internlm_offload.engine.trainer import Trainer

logger = get_logger(__name__)

USER_ERRORS = (ConfigError, DataError, CheckpointError, UnknownTypeError)
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_SAVE_FAILED = 4
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention


class BuildTrainer(Protocol):
    """`builder.build_trainer`, handed in by `train.py`: the run's trainer from its validated config."""

    def __call__(
        self,
        cfg: RunConfig,
        ctx: RunContext,
        work_dir: Path,
        *,
        predicted_device_peak: int | None = None,
        runtime_memory: int = 0,
    ) -> Trainer: ...


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train an LLM from a Python config file.")
    parser.add_argument("--config", required=True, help="Python config file (mmengine syntax, `_base_` allowed)")
    add_cfg_options(parser, help="override config keys, e.g. model.checkpoint=0.5 cpu_offloading.enable=True")
    parser.add_argument("--work-dir", help="output folder (default: work_dirs/<JOB_NAME>)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, *, build_trainer: BuildTrainer) -> int:
    """Parse `argv`, start the run (`build_trainer` makes its trainer once everything is validated) and
    train; the exit code (module docstring)."""
    try:
        return run(parse_args(argv), build_trainer)
    except USER_ERRORS as exc:
        report_error(exc)
        return EXIT_BAD_INPUT
    except TrainingDiverged as exc:
        report_error(exc)
        return EXIT_DIVERGED
    except CheckpointWriteError as exc:
        report_error(exc)
        return EXIT_SAVE_FAILED
    except KeyboardInterrupt:
        report_error(RuntimeError("interrupted (second Ctrl-C): stopped at once, no checkpoint of this step"))
        return EXIT_INTERRUPTED


def report_error(exc: BaseException) -> None:
    rank = os.environ.get("RANK", "0")
    print(f"{'' if rank == '0' else f'[rank {rank}] '}error: {exc}", file=sys.stderr)


def run(args: argparse.Namespace, build_trainer: BuildTrainer) -> int:
    # Validate everything that needs no process group first: a bad config never starts workers.
    raw = load_config_file(args.config, args.cfg_options)  # read once: the planner's candidates merge into it
    cfg = resolve_config(raw, world_size=env_world_size())
    if args.print_config:
        print(json.dumps(cfg.model_dump(), indent=2))
        return 0
    from internlm_offload.device import get_accelerator
    from internlm_offload.engine.runtime import init_runtime, shutdown_runtime
    from internlm_offload.engine.start_plan import check_named_weights

    check_named_weights(cfg)  # before the planner traces the configured model: the weights may be another one
    gc.freeze()  # torch's objects live as long as the process: see `freeze_what_lives_for_good`
    accelerator = get_accelerator(cfg.device)
    setup_logging(int(os.environ.get("RANK", "0")))
    accelerator.set_device(env_local_rank())
    runtime_bytes = accelerator.device_memory_in_use()  # the context and the like (engine/runtime_memory.py)
    traced, chosen = None, {}
    if cfg.auto_knobs:
        cfg, traced, chosen = choose_auto_knobs(cfg, raw, accelerator, runtime_bytes)
    predicted = (traced.device_peak_bytes, traced.host_peak_bytes) if traced else None
    if cfg.preflight:
        predicted = run_preflight(cfg, args.config, accelerator, runtime_bytes, traced) or predicted
    predicted_peak = None if predicted is None else comparable_peak(cfg, accelerator, *predicted)
    if cfg.auto_knobs and launched_by_torchrun():
        # every rank chose alone: the ranks join the group and take rank 0's choice before any mesh is built from it
        # (meshes of different shapes on different ranks would wait on each other forever)
        cfg = agree_on_auto_knobs(cfg, raw, init_runtime(accelerator), chosen)
    tensor = cfg.parallel.tensor.size
    ctx = init_runtime(
        accelerator,
        needs_group=cfg.parallel.mode != "none" or tensor > 1,
        tensor_size=tensor,
        expert_size=cfg.parallel.expert.size,
        expert_weight_size=cfg.parallel.expert_weight.size,
        experts_over_tensor=experts_over_tensor(cfg),
        chunked_loss=chunked_loss(cfg),
        pipeline_size=cfg.parallel.pipeline.size,
    )
    try:
        return train_in_runtime(args, cfg, ctx, build_trainer, predicted_peak, runtime_bytes)
    finally:
        shutdown_runtime()


def probe_kernel_memory(cfg: RunConfig, accelerator: Accelerator) -> int:
    """What the run's kernels keep after a probe step of one block (of each kind, for a family whose blocks differ:
    DeepSeek-V3's dense-first and sparse ones) (engine/runtime_memory.py); 0 for model families without such a copy
    (`hf_causal_lm`: their kernels' memory shows in the step readings; so did deepseek_v3's, 2.8 MiB of the tiny
    config's 41.4 MiB, -7.9 %, until it got its copy)."""
    kinds = block_kinds(cfg.model)
    if kinds is not None:
        one_block = with_blocks(cfg.model, list(dict.fromkeys(kinds)))  # each kind once, in the model's order
    elif capabilities(cfg.model.type).one_block_copy:
        one_block = cfg.model.model_copy(update={"num_layers": 1})
    else:
        one_block = None
    if one_block is None:
        return 0
    from internlm_offload.builder.model import build_probe_model
    from internlm_offload.engine.precision import DTYPES
    from internlm_offload.engine.runtime_memory import kernel_memory
    from internlm_offload.planner.trace import micro_batches

    return kernel_memory(
        accelerator,
        lambda: build_probe_model(one_block),
        micro_batches(cfg)[0],
        DTYPES[cfg.model.dtype],
        muon_kernels(cfg.model_copy(update={"model": one_block}), build_probe_model(one_block)),
    )


def muon_kernels(cfg: RunConfig, model: Any) -> Callable[[Any], None] | None:
    """Newton-Schulz at each shape of `model`'s Muon matrices (its groups as the run's optimizer makes them), for
    the kernel probe; None without Muon."""
    from internlm_offload.builder.optimizer import run_param_groups
    from internlm_offload.config.optimizer import uses_muon
    from internlm_offload.optim.muon_rule import MUON, ROW_SPLITS_KEY, block_shapes, orthogonalise_zeros
    from internlm_offload.optim.rules import RULE_KEY

    if not uses_muon(cfg.optimizer):
        return None
    groups = [g for g in run_param_groups(cfg, model) if g.get(RULE_KEY) == MUON.name]
    if not groups:
        return None
    shapes = {s for g in groups for p in g["params"] for s in block_shapes(p.shape, g.get(ROW_SPLITS_KEY))}
    return lambda device: orthogonalise_zeros(shapes, groups[0], device)


def freeze_what_lives_for_good() -> None:
    """Collect the start-up's garbage (the preflight's trace) and move what is left, modules and classes above
    all, into the collector's permanent generation: the full collections that follow (the kernel probe's, the
    shutdown's, the interpreter's own during training) then scan only what the run makes, where each took about
    0.15 s of CPU per process with torch's objects in sight. `run` froze torch's own objects after importing it,
    so this collection scans only what came since."""
    gc.collect()
    gc.freeze()


def train_in_runtime(
    args: argparse.Namespace,
    cfg: RunConfig,
    ctx: RunContext,
    build_trainer: BuildTrainer,
    predicted_peak: int | None,
    runtime_bytes: int = 0,
) -> int:
    """Everything after the process group is joined: start plan, build, resume or load, train."""
    from internlm_offload.engine.runtime import barrier, set_determinism
    from internlm_offload.engine.start_plan import plan_start

    notes, warnings = cfg.migration_notes()
    for line in notes:
        logger.info(line)
    for line in warnings:
        logger.warning(line)
    work_dir = Path(args.work_dir or Path("work_dirs") / cfg.JOB_NAME)
    if work_dir.exists() and not work_dir.is_dir():
        raise ConfigError(f"--work-dir {work_dir} is a file; give a folder (it is created when missing)")
    start = plan_start(cfg, work_dir, resume=args.resume, ctx=ctx)
    set_determinism(cfg.seed, cfg.deterministic, ctx.accelerator)  # before the first kernels (cuBLAS workspace)
    freeze_what_lives_for_good()
    if predicted_peak is not None:  # the probe's figure serves only the comparison with the prediction
        runtime_bytes += probe_kernel_memory(cfg, ctx.accelerator)  # before the builder's memory baseline
    trainer = build_trainer(cfg, ctx, work_dir, predicted_device_peak=predicted_peak, runtime_memory=runtime_bytes)
    if start.weights_from is not None:  # a LoRA resume too: its base, before the adapters
        trainer.load_weights_from(start.weights_from, cfg.model)
    if start.resume_from is not None:
        trainer.resume_from(start.resume_from)
    if ctx.is_main:
        write_run_files(cfg, work_dir, fresh=start.fresh)
    barrier(ctx)
    logger.info("Training %s: %d steps, work dir %s", cfg.JOB_NAME, cfg.data.total_steps, work_dir)
    try:
        trainer.train()
    finally:
        trainer.close()
    # Every rank leaves together: tearing down gloo while a peer is still inside a collective aborts it.
    barrier(ctx)
    if trainer.stopped_by is not None:
        logger.warning(
            "Stopped by %s after step %d; checkpoint written: continue with --resume", trainer.stopped_by, trainer.step
        )
        return 0
    logger.info("Done: %d steps, metrics in %s", trainer.step, work_dir / "metrics.jsonl")
    return 0


def choose_auto_knobs(
    cfg: RunConfig, raw: dict[str, Any], accelerator: Accelerator, runtime_bytes: int
) -> tuple[RunConfig, Any, dict[str, Any]]:
    """Set the config's "auto" knobs with the planner (`planner/auto.py`); the chosen config, its trace and the
    chosen knob values.

    `raw`: the loaded config `cfg` was resolved from; the candidates are merges of it. `runtime_bytes`: the
    device memory in use before the run, which the budget has to hold as well."""
    from internlm_offload.planner import auto
    from internlm_offload.planner.search import candidate_configs
    from internlm_offload.planner.trace import UnsupportedLayout

    config_for = candidate_configs(raw, world_size=env_world_size())
    try:
        chosen_cfg, chosen = auto.choose_auto_knobs(
            cfg, config_for, accelerator_name=accelerator.name, world_size=env_world_size(), runtime_bytes=runtime_bytes
        )
    except UnsupportedLayout as exc:
        raise ConfigError(f"memory_budget with 'auto' knobs: {exc}") from None
    return chosen_cfg, chosen.memory, chosen.options


def agree_on_auto_knobs(cfg: RunConfig, raw: dict[str, Any], ctx: RunContext, chosen: dict[str, Any]) -> RunConfig:
    """Every rank chose its "auto" knobs alone, before the process group existed, from its own step-time
    measurements (cpu calibrates per rank): rank 0's choice is the run's, so that all ranks build one layout
    (ranks in different tensor modes would wait on each other's collectives forever)."""
    from internlm_offload.engine.runtime import all_gather_object
    from internlm_offload.planner.search import candidate_configs

    first = all_gather_object(ctx, chosen)[0]
    if first == chosen:
        return cfg
    logger.warning("memory_budget: this rank chose %s; rank 0 chose %s, which the run takes", chosen, first)
    return candidate_configs(raw, world_size=ctx.world_size)(first)


def run_preflight(
    cfg: RunConfig, config_path: str, accelerator: Accelerator, runtime_bytes: int, traced: Any = None
) -> tuple[int, int] | None:
    """Stop (exit 2) before anything is allocated when the predicted step cannot fit this machine; the
    predicted device and host peaks (None for a model the trace cannot run). `runtime_bytes`: the device memory in
    use before the run; `traced`: the config's trace when the planner already made it."""
    from internlm_offload.planner.preflight import check_fits

    try:
        prediction = check_fits(
            cfg,
            world_size=env_world_size(),
            local_world_size=env_local_world_size(),
            device_total=accelerator.device_memory_bytes(env_local_rank()),
            config_path=config_path,
            runtime_bytes=runtime_bytes,
            traced=traced,
        )
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001  a model the trace cannot run must not stop a run that may fit
        logger.warning(
            "Preflight skipped: the step could not be traced (%s: %s)",
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        return None
    return prediction.device_peak, prediction.host_peak


def comparable_peak(cfg: RunConfig, accelerator: Accelerator, device_peak: int, host_peak: int) -> int:
    """The predicted figure the step's memory line compares with the measured device peak: the device
    peak, except on cpu under FSDP2's CPU offload policy, whose host tensors are ordinary cpu memory
    that the cpu backend counts as device memory (the trace places them as a GPU run would): both."""
    if accelerator.name == "cpu" and cfg.parallel.fsdp_cpu_offload:
        return device_peak + host_peak
    return device_peak


def write_run_files(cfg: RunConfig, work_dir: Path, *, fresh: bool) -> None:
    """The resolved config (as JSON and as a loadable Python config); a fresh run starts a new metrics file."""
    from mmengine.config import Config

    work_dir.mkdir(parents=True, exist_ok=True)
    resolved = cfg.model_dump()
    (work_dir / "config.json").write_text(json.dumps(resolved, indent=2) + "\n")
    # mmengine's layout (a key per line) without its yapf pass: the same loadable file, and yapf cost every run
    # about 50 ms of CPU (5 % of a tiny run's)
    Config(resolved, format_python_code=False).dump(str(work_dir / "config.py"))
    if fresh:
        (work_dir / "metrics.jsonl").unlink(missing_ok=True)
