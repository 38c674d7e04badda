"""Activation offload per pipeline rank: the uniform count a search chose, lowered rank by rank.

Under a pipeline each rank's peak depends on its own stages alone (its blocks and the micro-batches it holds in
flight; a trace keeps every rank's figures in `StepMemory.stages`), so the count one rank needs in order to fit
need not be paid by the others: under 1F1B stage s of P holds P - s micro-batches in flight, and the last stage,
with one, gains least from offloading. Each rank takes the fewest offloaded blocks, among the counts the search
offered (none included), whose estimated peak fits the device budget, as `cpu_offloading.num_layers=[n0, n1, ...]`.
Pure functions over settings and traced peaks; the search (`search.PricedMode.per_stage`) traces the result and
keeps it only when that trace fits.
"""

from __future__ import annotations

from collections.abc import Iterable

from internlm_offload.planner.knobs import Setting

OFFLOAD_KEYS = ("cpu_offloading.enable", "cpu_offloading.num_layers")


def offload_count(setting: Setting) -> int | None:
    """The blocks a setting offloads on every rank (0 when it turns offload off), None when it leaves offload as
    configured or sets a count per rank."""
    options = setting.options
    if options.get("cpu_offloading.enable") is False:
        return 0
    count = options.get("cpu_offloading.num_layers")
    return count if options.get("cpu_offloading.enable") and isinstance(count, int) else None


def offload_ladder(chosen: Setting, activations: Iterable[Setting]) -> dict[int, Setting]:
    """The activation settings equal to `chosen` but for their offload, by their uniform count; empty unless
    `chosen` offloads some blocks."""
    if not offload_count(chosen):
        return {}
    rest = {key: value for key, value in chosen.options.items() if key not in OFFLOAD_KEYS}
    ladder: dict[int, Setting] = {}
    for setting in activations:
        count = offload_count(setting)
        others = {key: value for key, value in setting.options.items() if key not in OFFLOAD_KEYS}
        if count is not None and others == rest:
            ladder.setdefault(count, setting)
    return ladder


def fewest_per_rank(peaks: dict[int, list[int]], budget: int, chosen: int) -> list[int]:
    """Each rank's fewest offloaded blocks whose estimated peak fits `budget` (`peaks`: count -> each rank's
    estimated device peak with that count), the `chosen` count where none fits."""
    ranks = len(peaks[chosen])
    counts = sorted(peaks)
    return [next((n for n in counts if peaks[n][r] <= budget), chosen) for r in range(ranks)]


def per_rank_setting(chosen: Setting, counts: list[int]) -> Setting:
    """`chosen` with its offload given per pipeline rank."""
    options = {**chosen.options, "cpu_offloading.enable": True, "cpu_offloading.num_layers": list(counts)}
    return Setting(f"offload {'/'.join(map(str, counts))} blocks per pipeline rank", options)
