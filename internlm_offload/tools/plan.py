"""Predict one training step's memory per rank without allocating it, and check it against budgets.

    python -m internlm_offload.tools.plan --config configs/x.py [--cfg-options k=v ...] [--world-size N]
        [--ranks-per-node R] [--device-memory 80GiB] [--host-memory 2TiB] [--json plan.json] [--measure]
        [--no-progress]

Traces three training steps of the configured run (forward, backward, optimizer step, with its offload
hooks, checkpointing and optimizer) on meta tensors through the builder's own wiring (see
`internlm_offload/planner/`), and reports the device and host bytes per component, the saved
activations per block and the peaks. `--measure` runs the same steps for real on cpu tensors and
prints measured beside predicted (small configs only).

The step time comes from a stated cost model (`planner/cost.py`) over the traced work: FLOPs, host<->device
bytes, AdamW elements and the tensor-parallel collectives' bytes, with the throughputs of `--hardware`
(assumed rows for H100, A100, Ascend 910B) or of this machine (`--calibrate`).

With a budget the planner also searches activation settings (none, checkpoint 0.5/1.0, offload of half or all
but one block) x optimizer settings (AdamW, hybrid 0.5/1.0, swap), in each tensor mode (mtp, msp, fsp, isp)
when `parallel.tensor.size` > 1, for the fastest predicted step that fits (`planner/search.py`), prints the
alternatives with why each was rejected and the choice as a `--cfg-options` line; `--check-only` checks the
config as given instead.

Ranks on one node share its host: `--host-memory` is the node's, each rank's budget its share over
`--ranks-per-node` (default: this machine's device count, or the world size up to 8 without devices),
and the host's memory bandwidth (copies, host adds, the CPU AdamW step) is shared the same way.

Exit codes: 0 the plan (or the choice) fits the budgets given, or none was given; 3 nothing fits (the
line says what dominates, or the smallest peak found); 2 bad input (config, option or size, or weights the
config names that its run would refuse).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from internlm_offload.config import (
    ConfigError,
    experts_over_tensor,
    experts_split_over_tensor,
    load_config_file,
    resolve_config,
)
from internlm_offload.config.file import add_cfg_options, merge_overrides
from internlm_offload.device import get_accelerator
from internlm_offload.errors import CheckpointError
from internlm_offload.family import block_count, capabilities, experts_per_token, routed_experts
from internlm_offload.planner.cost import HARDWARE, Hardware, calibrate, shared_by
from internlm_offload.planner.tracker import largest_component
from internlm_offload.config.sizes import human_bytes
from internlm_offload.config.sizes import parse_size as config_size

PROG = "plan"
EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3


class PlanInputError(ValueError):
    """Bad command-line input: one line naming the option, the value and what is allowed."""


def parse_size(text: str, option: str) -> int:
    """`80GiB`, `40GB`, `512MiB` or plain bytes -> bytes."""
    try:
        return config_size(text, option)
    except ValueError as exc:
        raise PlanInputError(str(exc).replace("=", " ", 1)) from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m internlm_offload.tools.{PROG}", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="Python config file, as for train.py")
    add_cfg_options(p, help="override config keys")
    p.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="ranks the run will use (the config's parallel.tensor.size of them form each tensor group)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        help="ranks sharing one node's host memory and bandwidth (default: this machine's device count, or the "
        "world size up to 8 on a machine without devices)",
    )
    p.add_argument("--device-memory", help="device budget per rank, e.g. 80GiB")
    p.add_argument("--host-memory", help="host memory of a node, shared by its ranks, e.g. 2TiB")
    p.add_argument(
        "--disk-memory",
        help="NVMe space of a node for the offloaded optimizer states, shared by its ranks, e.g. 8TiB; with it the "
        "search also tries the swap and hybrid settings with their states on NVMe",
    )
    p.add_argument(
        "--disk-bandwidth",
        type=float,
        help="NVMe read+write bandwidth of a node in GB/s (default: the assumption printed, 6 GB/s)",
    )
    p.add_argument(
        "--nvme-path",
        default="/local_nvme",
        help="with --disk-memory, the nvme_offload.path a config without one gets (the planner never touches it)",
    )
    p.add_argument("--json", type=Path, help="write the plan here as JSON")
    p.add_argument("--measure", action="store_true", help="also run the steps for real on cpu (small configs)")
    p.add_argument(
        "--hardware",
        choices=sorted(HARDWARE),
        default="h100",
        help="throughputs the step time is computed with (assumed; see docs/planner.md)",
    )
    p.add_argument("--calibrate", action="store_true", help="measure this machine's throughputs instead of --hardware")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar on stderr while searching (it shows only on a terminal anyway)",
    )
    p.add_argument(
        "--check-only",
        action="store_true",
        help="with budgets: check the config as given instead of searching for the fastest setting that fits",
    )
    return p.parse_args(argv)


def option_strings(options: dict[str, Any]) -> list[str]:
    """`--cfg-options` as `key=value` strings, as a user would type them again."""
    return [f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}" for key, value in options.items()]


def verdict(
    plan: dict[str, Any], device_budget: int | None, host_budget: int | None, disk_budget: int | None = None
) -> tuple[bool, str]:
    """Whether the predicted peaks fit the budgets, and a one-line reason."""
    from internlm_offload.planner.search import over_budget

    peaks = (plan["device_peak_bytes"], plan["host_peak_bytes"])
    problems = over_budget(*peaks, device_budget, host_budget, plan["disk_peak_bytes"], disk_budget)
    if problems:
        return False, "does not fit: " + "; ".join(
            f"{text} (largest: {largest_component(plan['components'], tier)})" for tier, text in problems
        )
    return True, "fits" if device_budget or host_budget else "no budget given"


def table(plan: dict[str, Any], measured: dict[str, Any] | None) -> str:
    """Components and peaks in MiB, one line each; measured beside predicted when given."""
    header = f"{'component (per rank)':<28}{'predicted MiB':>14}" + (f"{'measured MiB':>14}" if measured else "")
    lines = [header]
    rows = [
        *plan["components"].items(),
        ("device_peak", plan["device_peak_bytes"]),
        ("host_peak", plan["host_peak_bytes"]),
        ("disk_peak", plan["disk_peak_bytes"]),
    ]
    for name, value in rows:
        line = f"{name:<28}{value / 2**20:>14.2f}"
        if measured:
            other = measured["components"].get(name, measured.get(f"{name}_bytes", 0))
            line += f"{other / 2**20:>14.2f}"
        lines.append(line)
    blocks = ", ".join(f"{b / 2**20:.2f}" for b in plan["block_activation_bytes"])
    lines.append(f"activations left alive per block (MiB): {blocks}")
    return "\n".join(lines)


def stage_table(plan: dict[str, Any], measured: dict[str, Any] | None) -> str:
    """A pipeline's ranks: each one's device peak in MiB and its micro-batches in flight (torch's schedule order)."""
    worst = max(plan["stages"], key=lambda stage: stage["device_peak_bytes"])["pp_rank"]
    header = f"{'pipeline rank':<14}{'in flight':>10}{'activations MiB':>17}{'device peak MiB':>17}"
    lines = [
        f"components above: pipeline rank {worst}'s (the highest device peak); each rank's stages traced on their own",
        header + (f"{'measured MiB':>14}" if measured else ""),
    ]
    for i, stage in enumerate(plan["stages"]):
        line = (
            f"{stage['pp_rank']:<14}{stage['in_flight']:>10}{stage['activation_bytes'] / 2**20:>17.2f}"
            f"{stage['device_peak_bytes'] / 2**20:>17.2f}"
        )
        if measured:
            line += f"{measured['stages'][i]['device_peak_bytes'] / 2**20:>14.2f}"
        lines.append(line)
    return "\n".join(lines)


def step_line(micro_num: int, timing: Any, hardware: Hardware) -> str:
    """The predicted step time and its parts; a pipeline's with its bubble."""
    bubble = f", {timing.bubble_fraction:.1%} of it the pipeline's bubble" if timing.bubble_fraction else ""
    return (
        f"predicted step time {timing.step_s:.4g} s ({micro_num} micro-batches x {timing.micro_batch_s:.4g} s{bubble} "
        f"+ optimizer {timing.optimizer_s:.4g} s) on {hardware.name} [{hardware.source}]"
    )


def run(args: argparse.Namespace) -> int:
    """The plan (and with budgets the search) of `args`; its traces share DTensor's sharding decisions (nothing runs
    after them in this process)."""
    from internlm_offload.planner.trace import shared_sharding_decisions

    with shared_sharding_decisions():
        return plan_and_search(args)


def plan_and_search(args: argparse.Namespace) -> int:
    """See `run`."""
    from internlm_offload.planner.compose import APPROXIMATE_MARGIN, Tracer
    from internlm_offload.planner.knobs import WRAPPER
    from internlm_offload.planner.pipeline import planned_step_time
    from internlm_offload.planner.trace import UnsupportedLayout, trace_step  # heavy imports after parsing

    if args.world_size < 1:
        raise PlanInputError(f"--world-size {args.world_size}: expected an integer >= 1")
    ranks_per_node, assumed = ranks_on_a_node(args)
    device_budget = parse_size(args.device_memory, "--device-memory") if args.device_memory else None
    node_host = parse_size(args.host_memory, "--host-memory") if args.host_memory else None
    host_budget = None if node_host is None else node_host // ranks_per_node
    node_disk = parse_size(args.disk_memory, "--disk-memory") if args.disk_memory else None
    disk_budget = None if node_disk is None else node_disk // ranks_per_node
    if args.disk_bandwidth is not None and not args.disk_bandwidth > 0:
        raise PlanInputError(f"--disk-bandwidth {args.disk_bandwidth}: expected GB/s > 0")
    # read once: the search's candidates merge into it
    raw = with_device_budget(load_config_file(args.config, args.cfg_options), device_budget)
    cfg = resolve_config(raw, world_size=args.world_size)
    if node_disk is not None and cfg.nvme_offload.path is None:
        # A disk budget offers the NVMe tier: the search tries it (nvme_offload.enable) under this directory.
        args.cfg_options = {**args.cfg_options, "nvme_offload.path": args.nvme_path}
        raw = with_device_budget(load_config_file(args.config, args.cfg_options), device_budget)
        cfg = resolve_config(raw, world_size=args.world_size)
    check_weights(cfg)
    searching = bool(device_budget or host_budget) and not args.check_only
    tracer = Tracer(args.world_size)
    try:
        # the config as given: composed from its blocks when a search follows (which traces its choice whole), as the
        # search composes it, approximately where it is not composable (FSDP2 over several ranks: within
        # compose.APPROXIMATE_MARGIN; a whole 671B trace over 8 ranks is 32 s of CPU, a composed one 5 s)
        memory = tracer.step(cfg, approximate=True) if searching else tracer.whole(cfg, count_work=True)
        plan = memory.as_dict()
        measured = trace_step(cfg, args.world_size, measure=True).as_dict() if args.measure else None
    except UnsupportedLayout as exc:
        raise PlanInputError(str(exc)) from None
    fits, reason = verdict(plan, device_budget, host_budget, disk_budget)
    hardware = shared_by(row(args), ranks_per_node)
    timing = planned_step_time(cfg, memory.stages, memory.micro_batch_work, memory.optimizer_work, hardware)
    print(table(plan, measured))
    if searching and not tracer.exact(cfg):
        print(
            f"(composed from its blocks' traces, within {APPROXIMATE_MARGIN:.0%} for this layout; the search's choice "
            "is traced whole)"
        )
    if memory.stages:
        print(stage_table(plan, measured))
    print(step_line(memory.micro_num, timing, hardware))
    collectives = memory.micro_batch_work.collective_bytes
    if collectives:
        dims = (("tensor", cfg.parallel.tensor.size), ("expert", cfg.parallel.expert.size))
        which = " and ".join(name for name, size in dims if size > 1) + " parallel"
        print(
            f"{which}: {human_bytes(collectives)} sent per rank per micro-batch at "
            f"{hardware.collective_bytes_per_s / 1e9:.3g} GB/s [{hardware.collective_source}]"
        )
    if routed_experts(cfg.model):
        print(experts_assumption(cfg))
    if memory.disk_peak_bytes:
        print(
            f"NVMe: {human_bytes(memory.disk_peak_bytes)} per rank, {human_bytes(memory.optimizer_work.disk_bytes)} "
            f"read and written per step at {hardware.disk_bytes_per_s / 1e9:.3g} GB/s per rank [{hardware.disk_source}]"
        )
    print(
        f"{ranks_per_node} rank(s) per node{' (' + assumed + ')' if assumed else ''}: host peak "
        f"{human_bytes(plan['host_peak_bytes'] * ranks_per_node)} per node"
        + ("" if node_host is None else f" of {human_bytes(node_host)} ({human_bytes(host_budget)} per rank)")
    )
    print(f"{args.config} on {args.world_size} rank(s): {reason}")
    options = dict(args.cfg_options)
    parallel_mode = cfg.parallel.mode
    searched = None
    if searching:
        searched, chosen = run_search(args, raw, hardware, device_budget, host_budget, disk_budget, tracer)
        fits = chosen is not None
        if chosen is not None:
            memory, options = chosen.memory, {**options, **chosen.options}
            parallel_mode = chosen.options.get(WRAPPER, parallel_mode)
            plan = memory.as_dict()
            chosen_cfg = resolve_config(merge_overrides(raw, chosen.options), world_size=args.world_size)
            timing = planned_step_time(
                chosen_cfg, memory.stages, memory.micro_batch_work, memory.optimizer_work, hardware
            )
            reason = f"chosen: {chosen.name}"
        else:
            reason = "nothing fits"
    report = {
        **plan,
        "fits": fits,
        "verdict": reason,
        "cfg_options": option_strings(options),
        "parallel_mode": parallel_mode,
        "step_time_s": timing.step_s,
        "step_time": timing.as_dict(),
        "search": searched,
        "config": str(args.config),
        "device_budget_bytes": device_budget,
        "host_budget_bytes": host_budget,
        "ranks_per_node": ranks_per_node,
        "node_host_budget_bytes": node_host,
        "disk_budget_bytes": disk_budget,
        "measured": measured,
        "traces": tracer.traces,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if fits else EXIT_DOES_NOT_FIT


def with_device_budget(raw: dict[str, Any], device_budget: int | None) -> dict[str, Any]:
    """The loaded config with `--device-memory` as its `memory_budget.device` where it names none: the budget its
    "auto" knobs need (the search reads the option itself; a config's own budget stays, as train.py would use it)."""
    budget = raw.get("memory_budget")
    if device_budget is None or (isinstance(budget, dict) and budget.get("device") is not None):
        return raw
    return merge_overrides(raw, {"memory_budget.device": device_budget})


def check_weights(cfg: Any) -> None:
    """train.py's refusal of the weights the config names (engine/start_plan.check_named_weights), where they are
    on this machine: a config planned away from its cluster plans the configured model, which its run trains or
    refuses."""
    from internlm_offload.engine.start_plan import check_named_weights

    info = cfg.ckpt.load_ckpt_info
    if info is not None and Path(info.path).exists():
        check_named_weights(cfg)


def row(args: argparse.Namespace) -> Hardware:
    """The hardware row: `--hardware` (assumed) or `--calibrate` (measured), with `--disk-bandwidth`."""
    hardware = calibrate() if args.calibrate else HARDWARE[args.hardware]
    if args.disk_bandwidth is None:
        return hardware
    return dataclasses.replace(
        hardware, disk_bytes_per_s=args.disk_bandwidth * 1e9, disk_source=f"--disk-bandwidth {args.disk_bandwidth} GB/s"
    )


def ranks_on_a_node(args: argparse.Namespace) -> tuple[int, str]:
    """`--ranks-per-node`, or its default and the assumption behind it (empty when given)."""
    if args.ranks_per_node is not None:
        if not 1 <= args.ranks_per_node <= args.world_size:
            raise PlanInputError(
                f"--ranks-per-node {args.ranks_per_node}: expected an integer from 1 to --world-size ({args.world_size})"
            )
        return args.ranks_per_node, ""
    devices = get_accelerator().device_count()
    if devices:
        return min(devices, args.world_size), f"assumed: this machine's {devices} devices"
    ranks = min(args.world_size, 8)
    return ranks, f"assumed: {ranks} of a node's 8 devices; set --ranks-per-node"


def experts_assumption(cfg: Any) -> str:
    """What the trace of a mixture of experts assumes about routing, stated as the hardware rows are."""
    from internlm_offload.model.router import gshard_capacity

    model, data = cfg.model, cfg.data
    # the family's counts (a deepseek_v3 model's come from its config.json, its routing is dropless)
    experts, top_k = routed_experts(model), experts_per_token(model)
    moe_type = model.moe_type if capabilities(model.type).native_experts else "Dropless"
    # a rank's tokens: its chunk of the sequence where each tensor rank routes its own (isp; mtp/msp/fsp's no_tp)
    chunks = cfg.parallel.tensor.size if experts_over_tensor(cfg) else 1
    tokens = data.micro_bsz * data.seq_len // chunks
    rows = tokens * top_k
    kwargs = model.moe_layer_kwargs
    dropped = ""
    if moe_type == "GShard" and kwargs.drop_tokens:
        capacity = gshard_capacity(tokens, experts, top_k, kwargs.capacity_factor, kwargs.min_capacity)
        dropped = f"; GShard's capacity of {capacity} per expert drops choices from the output, not from the buffers"
    share = f" (this rank's 1/{chunks} of the sequence)" if chunks > 1 else ""
    head = (
        f"mixture of experts: {experts} experts, top-{top_k}, {moe_type}: {rows} routed rows "
        f"per sparse block per micro-batch{share} through one grouped GEMM{dropped}"
    )
    ep = cfg.parallel.expert.size
    if ep == 1:
        holds = "every expert"
        if experts_split_over_tensor(cfg):  # no_tp=False: every rank routes all the tokens through its slices
            holds = f"1/{cfg.parallel.tensor.size} of every expert's width (no_tp=False)"
        return (
            f"{head} [assumed: one rank holds {holds}, so its memory and FLOPs do not depend on how the router "
            "spreads the tokens; with expert parallel the busiest rank's share would]"
        )
    imbalance = min(cfg.memory_budget.expert_imbalance, ep)
    return (
        f"{head}; expert parallel over {ep} ranks: {experts // ep} experts per rank, all {rows} rows sent "
        f"by all-to-all, {round(imbalance * rows)} received [assumed: memory_budget.expert_imbalance="
        f"{cfg.memory_budget.expert_imbalance}: the busiest rank receives {imbalance:g} x the mean, every row kept; "
        "its buffers, expert activations and FLOPs are traced at that size]"
    )


def run_search(
    args: argparse.Namespace,
    raw: dict[str, Any],
    hardware: Any,
    device_budget: int | None,
    host_budget: int | None,
    disk_budget: int | None = None,
    tracer: Any = None,
) -> tuple[list[dict[str, Any]], Any]:
    """Search the settings, print the alternatives and the choice; (JSON rows, the chosen candidate or None).

    `raw`: the loaded config (`--config` with `--cfg-options`); the candidates are merges of it."""
    from internlm_offload.planner.progress import SearchProgress
    from internlm_offload.planner.knobs import WRAPPER, Space
    from internlm_offload.planner.search import Budgets, candidate_configs, search_space, smallest_peak

    config_for = candidate_configs(raw, world_size=args.world_size)
    # every knob searched, smaller micro-batches too; parameter offload switches the wrapper to FSDP2 unless
    # the config names one; each tensor mode, with tensor groups of several ranks
    space = Space(
        config_for({}),
        num_layers=block_count(config_for({}).model),  # the folder's blocks (config.json), not model.num_layers
        free_wrapper=leaves_wrapper_open(raw),
        shapes=True,
        world_size=args.world_size,
    )
    progress = SearchProgress(enabled=sys.stderr.isatty() and not args.no_progress)
    try:
        chosen, candidates, refused = search_space(
            config_for, space, hardware, device_budget, host_budget, disk_budget, tracer=tracer, progress=progress
        )
    finally:
        progress.close()
    for line in refused:
        print(f"layout {line}")
    print(f"\n{'setting':<52}{'step s':>11}{'est. device':>13}{'est. host':>11}  verdict")
    rows = []
    for c in candidates:
        print(
            f"{c.name:<52}{c.step_s:>11.4g}{human_bytes(c.estimated_device):>13}{human_bytes(c.estimated_host):>11}  "
            f"{c.verdict}"
        )
        rows.append(
            {
                "setting": c.name,
                "cfg_options": option_strings(c.options),
                "parallel_mode": c.options.get(WRAPPER, config_for({}).parallel.mode),
                "step_time_s": c.step_s,
                "estimated_device_peak_bytes": c.estimated_device,
                "estimated_host_peak_bytes": c.estimated_host,
                "verdict": c.verdict,
            }
        )
    print(f"{len(candidates)} candidates, {tracer.traces} traces (blocks traced once per run and composed)")
    if chosen is not None:
        print(f"choice: --cfg-options {' '.join(option_strings(chosen.options))}")
        mode = chosen.options.get(WRAPPER, config_for({}).parallel.mode)
        print(
            f"{args.config} on {args.world_size} rank(s): fits with {chosen.name} under parallel.mode={mode!r}, "
            f"predicted step {chosen.step_s:.4g} s"
        )
    else:
        budgets = Budgets(device_budget, host_budget, disk_budget)
        smallest = smallest_peak(candidates, config_for, args.world_size, tracer, budgets)
        print(f"{args.config} on {args.world_size} rank(s): nothing fits: {smallest}")
    return rows, chosen


def leaves_wrapper_open(raw: dict[str, Any]) -> bool:
    """Whether the loaded config (file and `--cfg-options`) names no `parallel.mode`: then the search may choose it."""
    parallel = raw.get("parallel")
    return not (isinstance(parallel, dict) and "mode" in parallel)


def main(argv: list[str] | None = None) -> int:
    try:
        return run(parse_args(argv))
    except (PlanInputError, ConfigError, CheckpointError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
