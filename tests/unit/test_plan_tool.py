"""`python -m internlm_offload.tools.plan`: the report, the JSON, budgets and exit codes."""

import dataclasses
import json
from pathlib import Path

import pytest

from internlm_offload.tools import plan

pytestmark = pytest.mark.usefixtures("shared_traces")  # repeated searches read their traces once (CI time)

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "internlm2_tiny.py")
SMALL = ["data.seq_len=64", "data.micro_bsz=2", "data.micro_num=2", "data.global_bsz=4"]
# The searches below: what they check (the order of choices, the NVMe tier's place in it) does not depend on the
# depth, and two blocks halve each of their 15 to 30 traces (CI time).
SEARCHED = [*SMALL, "model.num_layers=2"]


def test_json_report_and_measured_column(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["--config", TINY, "--cfg-options", *SMALL, "swap_optimizer=True", "--json", str(out), "--measure"]
    assert plan.main(argv) == 0
    report = json.loads(out.read_text())
    for key in ("device_peak_bytes", "host_peak_bytes", "fits", "components", "cfg_options", "measured"):
        assert key in report, key
    assert report["fits"] is True and "swap_optimizer=True" in report["cfg_options"]
    assert report["components"]["host_optimizer_states"] > 0 == report["components"]["optimizer_states"]
    assert report["measured"]["device_peak_bytes"] == pytest.approx(report["device_peak_bytes"], rel=1e-3)
    assert report["step_time_s"] > 0 and report["step_time"]["hardware"]["source"].startswith("assumed")
    printed = capsys.readouterr().out
    assert "measured MiB" in printed and "no budget given" in printed and "on H100" in printed


def test_a_slower_link_predicts_a_slower_swap_step(tmp_path):
    """The step time follows the hardware row: swap's state copies take twice as long over A100's PCIe 4.0."""
    times = {}
    for hardware in ("h100", "a100"):
        out = tmp_path / f"{hardware}.json"
        argv = ["--config", TINY, "--cfg-options", *SMALL, "swap_optimizer=True", "--hardware", hardware]
        assert plan.main([*argv, "--json", str(out)]) == 0
        times[hardware] = json.loads(out.read_text())["step_time"]
    assert times["a100"]["optimizer_s"] > times["h100"]["optimizer_s"] > 0
    assert times["a100"]["step_s"] > times["h100"]["step_s"]


def test_a_budget_below_the_peak_exits_3_naming_what_dominates(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan.main(["--config", TINY, "--cfg-options", *SMALL, "--json", str(out)]) == 0
    peak = json.loads(out.read_text())["device_peak_bytes"]
    check = ["--config", TINY, "--check-only", "--cfg-options", *SMALL]
    assert plan.main([*check, "--device-memory", str(peak)]) == 0
    assert plan.main([*check, "--device-memory", str(peak - 1)]) == 3
    line = capsys.readouterr().out.splitlines()[-1]
    assert "does not fit: device peak" in line and "largest: " in line


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device-memory", "80XB"], "--device-memory '80XB'"),
        (["--host-memory=-1GiB"], "--host-memory '-1GiB'"),
        (["--world-size", "0"], "--world-size 0"),
        (["--ranks-per-node", "0"], "--ranks-per-node 0"),
        (["--world-size", "2", "--ranks-per-node", "4"], "--ranks-per-node 4: expected an integer from 1 to"),
        (["--cfg-options", "model.nope=1"], "model.nope"),
        (["--cfg-options", "data.seq_len=[1,2"], "--cfg-options data.seq_len=[1,2: cannot parse the value"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert plan.main(["--config", TINY, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("plan: error:") and message in err and "\n" not in err


def test_ranks_on_a_node_share_its_host_memory_and_bandwidth(tmp_path, capsys):
    """--host-memory is the node's: each of 4 ranks gets a quarter of it, and of the host's bandwidth (swap's
    state copies then take more than twice as long as with one rank on the node)."""
    steps = {}
    for ranks in (1, 4):
        out = tmp_path / f"{ranks}.json"
        argv = ["--config", TINY, "--world-size", "4", "--ranks-per-node", str(ranks), "--check-only"]
        options = [*SMALL, "data.global_bsz=16", "parallel.mode=fsdp2", "swap_optimizer=True"]
        assert plan.main([*argv, "--host-memory", "4GiB", "--cfg-options", *options, "--json", str(out)]) == 0
        report = json.loads(out.read_text())
        assert report["ranks_per_node"] == ranks and report["host_budget_bytes"] == 4 * 2**30 // ranks
        steps[ranks] = report["step_time"]
    assert "4 rank(s) per node: host peak" in capsys.readouterr().out
    # 84 GB/s of host bandwidth (the H100 row's) over 4 ranks: 21 GB/s each, below the 50 GB/s link
    assert steps[4]["hardware"]["link_bytes_per_s"] == pytest.approx(21e9)
    assert steps[4]["optimizer_s"] > 2 * steps[1]["optimizer_s"]


def test_a_shared_host_divides_the_host_bandwidth():
    from internlm_offload.planner.cost import HARDWARE, host_bytes_per_s, shared_by

    h100 = HARDWARE["h100"]
    assert shared_by(h100, 1) is h100
    node = shared_by(h100, 8)  # 84 GB/s of host bandwidth over 8 ranks: 10.5 GB/s each, below the 50 GB/s link
    assert node.link_bytes_per_s == pytest.approx(host_bytes_per_s(h100) / 8)
    assert node.cpu_adam_elements_per_s == h100.cpu_adam_elements_per_s / 8
    wide = shared_by(dataclasses.replace(h100, cpu_adam_elements_per_s=1e10), 2)  # 140 GB/s each
    assert wide.link_bytes_per_s == h100.link_bytes_per_s  # the device's link is the limit


@pytest.mark.parametrize(
    "text, expected", [("80GiB", 80 * 2**30), ("40GB", 40 * 10**9), ("1.5MiB", 3 * 2**19), ("4096", 4096)]
)
def test_sizes(text, expected):
    assert plan.parse_size(text, "--device-memory") == expected


def test_search_picks_the_fastest_setting_that_fits_and_never_speeds_up_as_the_budget_shrinks(tmp_path, capsys):
    out = tmp_path / "base.json"
    assert plan.main(["--config", TINY, "--cfg-options", *SEARCHED, "--json", str(out)]) == 0
    baseline = json.loads(out.read_text())
    chosen = []
    for fraction in (1.0, 0.6):
        budget = int(baseline["device_peak_bytes"] * fraction)
        out = tmp_path / f"{fraction}.json"
        assert (
            plan.main(
                ["--config", TINY, "--cfg-options", *SEARCHED, "--device-memory", str(budget), "--json", str(out)]
            )
            == 0
        )
        report = json.loads(out.read_text())
        assert report["device_peak_bytes"] <= budget  # the choice was traced whole and fits
        assert [r["verdict"] for r in report["search"]].count("chosen") == 1
        chosen.append(report["step_time_s"])
    assert chosen == sorted(chosen) and chosen[0] == pytest.approx(baseline["step_time_s"])
    assert "choice: --cfg-options" in capsys.readouterr().out
    assert plan.main(["--config", TINY, "--cfg-options", *SEARCHED, "--device-memory", "1MiB"]) == 3
    assert "nothing fits: smallest device peak" in capsys.readouterr().out.splitlines()[-1]


def _spaces(auto: tuple[str, ...], **raw) -> tuple[list[dict], list[dict]]:
    from internlm_offload.config import resolve_config
    from internlm_offload.planner.knobs import activation_settings, optimizer_settings

    cfg = resolve_config(raw)
    return [s.options for s in activation_settings(8, auto)], [s.options for s in optimizer_settings(cfg, auto)]


def test_search_space_covers_the_auto_knobs_only() -> None:
    activations, optimizers = _spaces(("model.checkpoint",))
    assert activations == [{"model.checkpoint": c} for c in (0.0, 0.5, 1.0)] and optimizers == [{}]
    activations, optimizers = _spaces(("cpu_offloading.num_layers", "swap_optimizer"))
    assert [a.get("cpu_offloading.num_layers") for a in activations] == [0, 4, 7]
    assert all(a["cpu_offloading.enable"] == (a["cpu_offloading.num_layers"] > 0) for a in activations)
    assert optimizers == [{"swap_optimizer": False}, {"swap_optimizer": True}]


def test_search_space_keeps_what_the_config_fixes() -> None:
    # The hybrid optimizer is fixed on: swap (which excludes it) is not tried, its fraction is.
    _, optimizers = _spaces(("swap_optimizer", "hybrid_optimizer.offload_fraction"), hybrid_optimizer={"enable": True})
    assert optimizers == [{"hybrid_optimizer.offload_fraction": 0.5}, {"hybrid_optimizer.offload_fraction": 1.0}]
    _, optimizers = _spaces(("hybrid_optimizer.enable",), swap_optimizer=True)
    assert optimizers == [{}]
    _, optimizers = _spaces(("hybrid_optimizer.enable", "hybrid_optimizer.offload_fraction", "swap_optimizer"))
    assert [o.get("hybrid_optimizer.offload_fraction") for o in optimizers] == [None, 0.5, 1.0, None]
    assert optimizers[-1] == {"swap_optimizer": True, "hybrid_optimizer.enable": False}

    # FSDP2's CPU offload policy keeps the states on the host: neither swap nor hybrid is tried.
    auto = ("hybrid_optimizer.enable", "hybrid_optimizer.offload_fraction", "swap_optimizer")
    _, optimizers = _spaces(auto, parallel={"mode": "fsdp2", "fsdp_cpu_offload": True})
    assert optimizers == [{}]
    _, optimizers = _spaces(("parallel.fsdp_cpu_offload",), parallel={"mode": "fsdp2"})
    assert optimizers == [{"parallel.fsdp_cpu_offload": False}, {"parallel.fsdp_cpu_offload": True}]
    _, optimizers = _spaces(("parallel.fsdp_cpu_offload",), parallel={"mode": "fsdp2"}, swap_optimizer=True)
    assert optimizers == [{}]  # a fixed swap optimizer excludes it


@pytest.mark.parametrize("mode", ["none", "fsdp2"])
def test_plan_searches_parameter_offload_under_fsdp2_and_gradient_offload(monkeypatch, mode) -> None:
    from types import SimpleNamespace

    from internlm_offload.planner import search

    searched = []

    def record(config_for, activations, optimizers, *args):
        searched.extend(s.options for s in optimizers)
        return SimpleNamespace(candidates=[])

    monkeypatch.setattr(search, "priced", record)
    monkeypatch.setattr(search, "smallest_peak", lambda *args: "")
    argv = ["--config", TINY, "--cfg-options", *SMALL, f"parallel.mode={mode}", "--device-memory", "20MiB"]
    plan.main(argv)
    on_host = [o for o in searched if o.get("parallel.fsdp_cpu_offload")]
    grads_on_host = [o for o in searched if o.get("grad_offload")]
    # hybrid 1.0 and swap again with gradient offload, in every mode
    assert [(o.get("hybrid_optimizer.offload_fraction"), o.get("swap_optimizer")) for o in grads_on_host] == [
        (1.0, False),
        (None, True),
    ]
    if mode == "none":  # AdamW, hybrid 0.5 and 1.0, swap, and the two above
        assert not on_host and len(searched) == 6
    else:  # the policy excludes the swap and hybrid optimizers, and so gradient offload
        assert on_host == [
            {
                "swap_optimizer": False,
                "hybrid_optimizer.enable": False,
                "parallel.fsdp_cpu_offload": True,
                "grad_offload": False,
            }
        ]
        assert all(o.get("parallel.fsdp_cpu_offload") is False for o in searched if o not in on_host)


def test_smaller_micro_batches_keep_the_global_batch() -> None:
    from internlm_offload.config import load_config_file, resolve_config
    from internlm_offload.planner.knobs import batch_settings

    def config(**options):
        return resolve_config(load_config_file(TINY, {"data.micro_bsz": 8, "data.global_bsz": 24, **options}))

    settings = batch_settings(config())
    assert [s.name for s in settings] == ["micro_bsz 8 x 3", "micro_bsz 4 x 6", "micro_bsz 2 x 12", "micro_bsz 1 x 24"]
    for setting in settings:
        data = config(**setting.options).data
        assert data.micro_bsz * data.micro_num == 24 and data.global_bsz == 24


def test_search_prefers_a_smaller_micro_batch_to_recomputation_at_equal_work(tmp_path) -> None:
    """Where the configured micro-batch (2 x 2) does not fit but 1 x 4 does, the same FLOPs in smaller
    micro-batches win over checkpointing, which recomputes (on two blocks, `SEARCHED`)."""
    out = tmp_path / "small.json"
    assert plan.main(["--config", TINY, "--cfg-options", *SEARCHED, "data.micro_bsz=1", "--json", str(out)]) == 0
    smaller = json.loads(out.read_text())
    out = tmp_path / "chosen.json"
    budget = str(smaller["device_peak_bytes"])
    argv = ["--config", TINY, "--cfg-options", *SEARCHED, "--device-memory", budget, "--json", str(out)]
    assert plan.main(argv) == 0
    report = json.loads(out.read_text())
    assert "data.micro_bsz=1" in report["cfg_options"] and "model.checkpoint=0.0" in report["cfg_options"]
    assert report["step_time_s"] == pytest.approx(smaller["step_time_s"])


@pytest.mark.parametrize(
    "peaks",
    [
        # the lean activation setting's column: 90 + 20 - 90 + ... = 20 for (lean, o1)
        {("full", "o0"): 100, ("lean", "o0"): 90, ("full", "o1"): 95, ("lean", "o1"): 20},
        # the base activation is the leanest; the lean optimizer's row gives (lean, o1) its own trace
        {("full", "o0"): 100, ("lean", "o0"): 110, ("full", "o1"): 95, ("lean", "o1"): 20},
    ],
    ids=["lean-activation", "lean-optimizer"],
)
def test_search_refines_an_estimate_along_the_leanest_settings(monkeypatch, peaks) -> None:
    """The optimizer setting saves little beside the base activations (the peak sits elsewhere) and much
    beside the others: the first estimate (85 or 105) is over the budget, a lean one (20) is not, and the
    candidate is traced and chosen; without the refinement nothing would fit."""
    from internlm_offload.planner import search
    from internlm_offload.planner.cost import HARDWARE
    from internlm_offload.planner.trace import StepMemory

    traced = []

    def trace(options, world_size):
        traced.append((options["a"], options["o"]))
        return StepMemory(world_size, peaks[options["a"], options["o"]], 0, {}, [])

    class Tracer:  # each step as `trace` gives it, composed or whole
        def __init__(self, world_size=1):
            self.traces = 0

        def step(self, options, count_work=True, approximate=False):
            return trace(options, 1)

        def exact(self, options):
            return True

        def whole(self, options, count_work=False):
            return StepMemory(1, peaks[options["a"], options["o"]], 0, {}, [])

    monkeypatch.setattr(search, "Tracer", Tracer)
    activations = [search.Setting("full", {"a": "full"}), search.Setting("lean", {"a": "lean"})]
    optimizers = [search.Setting("o0", {"o": "o0"}), search.Setting("o1", {"o": "o1"})]
    chosen, _candidates = search.search(lambda options: options, activations, optimizers, HARDWARE["h100"], 50, None)
    assert chosen is not None and chosen.name == "lean + o1" and chosen.memory.device_peak_bytes == 20
    assert traced.count(("lean", "o1")) == 1  # traced for the estimate, and that trace is the one the choice checks


def test_a_disk_budget_lets_the_search_put_the_states_on_nvme(tmp_path):
    """Host memory too small for the swap optimizer's states: with --disk-memory the search tries the swap
    settings with their states on NVMe, traces them on a disk tier, and chooses one; the states' reads and
    writes are priced at --disk-bandwidth."""
    base = tmp_path / "base.json"
    assert plan.main(["--config", TINY, "--cfg-options", *SEARCHED, "swap_optimizer=True", "--json", str(base)]) == 0
    swap = json.loads(base.read_text())
    states = swap["components"]["host_optimizer_states"]
    budgets = ["--device-memory", str(swap["device_peak_bytes"]), "--host-memory", str(states // 4)]
    argv = ["--config", TINY, "--cfg-options", *SEARCHED, "model.checkpoint=1.0", *budgets]
    out = tmp_path / "nvme.json"
    assert plan.main([*argv, "--disk-memory", "1GiB", "--disk-bandwidth", "0.001", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "nvme_offload.path='/local_nvme'" in report["cfg_options"] and "+ NVMe" in report["verdict"]
    assert "nvme_offload.enable=True" in report["cfg_options"]
    # at 1 MB/s the NVMe settings are the slowest: every other one was tried first, and none fits
    others = [row for row in report["search"] if "+ NVMe" not in row["setting"]]
    assert others and all(row["verdict"].startswith(("estimated", "traced")) for row in others)
    assert report["disk_peak_bytes"] == report["components"]["disk_optimizer_states"] >= 0.99 * states
    assert report["components"]["host_optimizer_states"] == 0
    # 1 MB/s: the states' bytes read and written each step take seconds, far beyond the link's time
    assert report["step_time"]["optimizer_s"] > 2 * states / 1e6 * 0.99


def test_the_nvme_tier_is_a_knob_where_the_config_names_a_directory() -> None:
    """`nvme_offload.enable="auto"` with a path: the start-up search tries the optimizers that offload states
    (swap, hybrid) with them on NVMe too; without a path there is nothing to try."""
    from internlm_offload.config import load_config_file, resolve_config
    from internlm_offload.planner.knobs import optimizer_settings

    auto = {"swap_optimizer": "auto", "hybrid_optimizer.enable": "auto", "memory_budget.device": "1GiB"}
    raw = load_config_file(TINY, {**auto, "nvme_offload.enable": "auto", "nvme_offload.path": "/nvme"})
    cfg = resolve_config(raw)
    settings = optimizer_settings(cfg, cfg.auto_knobs)
    on_disk = [s.name for s in settings if s.options.get("nvme_offload.enable")]
    assert on_disk == ["hybrid 0.5 + NVMe", "swap + NVMe"]
    assert all(s.options.get("nvme_offload.enable") is False for s in settings if s.name not in on_disk)
    without_path = resolve_config(load_config_file(TINY, auto))
    assert not any("NVMe" in s.name for s in optimizer_settings(without_path, without_path.auto_knobs))


def test_parameter_offload_switches_an_open_wrapper_to_fsdp2() -> None:
    """One rank, no parallel.mode in the config (the default 'none'): parameter offload is still searched, its
    setting switching the wrapper to FSDP2, and a budget only it fits chooses it; a config that names its wrapper
    keeps it, and then parameter offload is not a candidate."""
    from internlm_offload.config import load_config_file
    from internlm_offload.planner.cost import HARDWARE
    from internlm_offload.planner.knobs import activation_settings, optimizer_settings
    from internlm_offload.planner.search import candidate_configs, search

    overrides = {"data.seq_len": 64, "data.micro_bsz": 2, "data.micro_num": 2, "model.dtype": "torch.bfloat16"}
    raw = load_config_file(TINY, overrides)
    assert plan.leaves_wrapper_open(raw)
    config_for = candidate_configs(raw)
    knob = ("parallel.fsdp_cpu_offload",)
    optimizers = optimizer_settings(config_for({}), knob, free_wrapper=True)
    assert [o.options for o in optimizers] == [
        {"parallel.fsdp_cpu_offload": False},
        {"parallel.mode": "fsdp2", "parallel.fsdp_cpu_offload": True},
    ]
    budget = 5 * 2**20  # as configured 9.1 MiB traced on the device; with FSDP2's CPU offload policy 4.2 MiB
    chosen, tried = search(config_for, activation_settings(4, ()), optimizers, HARDWARE["h100"], budget, None)
    assert chosen is not None and chosen.options["parallel.mode"] == "fsdp2", [(c.name, c.verdict) for c in tried]
    assert chosen.memory.device_peak_bytes <= budget
    named = load_config_file(TINY, {**overrides, "parallel.mode": "none"})
    assert not plan.leaves_wrapper_open(named)
    assert [o.options for o in optimizer_settings(candidate_configs(named)({}), knob)] == [{}]


def test_a_mixture_of_experts_states_its_routing_assumption(capsys) -> None:
    """The rows one grouped GEMM takes per sparse block (tokens x top-k), GShard's capacity, and the assumption that
    one rank's memory does not depend on the router's spread, printed as the hardware rows are."""
    moe = str(Path(TINY).with_name("internlm2_tiny_moe.py"))
    assert plan.main(["--config", moe, "--cfg-options", *SMALL]) == 0
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if line.startswith("mixture of experts"))
    assert line.startswith("mixture of experts: 4 experts, top-2, GShard: 256 routed rows per sparse block")
    assert "capacity of 64 per expert" in line and "[assumed: one rank holds every expert" in line


def test_expert_parallel_states_its_imbalance_assumption_and_prices_the_all_to_all(capsys) -> None:
    """Under expert parallel the line says how many experts a rank holds and how many rows it is assumed to
    receive (`memory_budget.expert_imbalance`), and the all-to-all's bytes are printed at the collective rate."""
    moe = str(Path(TINY).with_name("internlm2_tiny_moe.py"))
    options = [*SMALL, "parallel.mode='ddp'", "parallel.expert.size=2", "memory_budget.expert_imbalance=1.5"]
    assert plan.main(["--config", moe, "--world-size", "2", "--cfg-options", *options]) == 0
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if line.startswith("mixture of experts"))
    assert "expert parallel over 2 ranks: 2 experts per rank, all 256 rows sent by all-to-all, 384 received" in line
    assert "[assumed: memory_budget.expert_imbalance=1.5: the busiest rank receives 1.5 x the mean" in line
    assert next(line for line in printed.splitlines() if line.startswith("expert parallel: ")).endswith(
        "GB/s [assumed: NVLink 4 (450 GB/s per direction), ~80% as NCCL's bus bandwidth]"
    )


def test_a_native_config_naming_a_folder_of_another_architecture_is_refused_as_train_py_refuses_it(
    tmp_path, capsys, monkeypatch
) -> None:
    """A DeepSeek-V3 folder in the tiny native config's `ckpt.load_ckpt_info`: tools.plan exits 2 with train.py's
    one line (it planned the tiny model: 'fits'), and train.py says it before the preflight traces anything; a
    folder not on this machine is the run's to check (planned off the cluster)."""
    from transformers import AutoConfig

    from internlm_offload import launch

    AutoConfig.for_model("deepseek_v3").save_pretrained(str(tmp_path / "dsv3"))
    config = tmp_path / "native.py"
    info = f"dict(path={str(tmp_path / 'dsv3')!r}, content=('model',), ckpt_type='hf')"
    config.write_text(f"_base_ = [{TINY!r}]\nckpt = dict(load_ckpt_info={info})\n")
    assert plan.main(["--config", str(config), "--cfg-options", *SMALL]) == 2
    refusal = f"{tmp_path / 'dsv3' / 'config.json'}: model_type='deepseek_v3'; the native model loads"
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"plan: error: {refusal}") and "\n" not in err
    monkeypatch.setattr(launch, "run_preflight", lambda *args, **kwargs: pytest.fail("traced before the refusal"))
    assert launch.main(["--config", str(config), "--cfg-options", *SMALL], build_trainer=None) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {refusal}")
    elsewhere = f"ckpt.load_ckpt_info.path={str(tmp_path / 'on_the_cluster')!r}"
    assert plan.main(["--config", str(config), "--check-only", "--cfg-options", *SMALL, elsewhere]) == 0


def test_device_memory_is_the_budget_an_auto_knob_needs(capsys) -> None:
    """`parallel.expert.size="auto"` asked tools.plan for `memory_budget.device` although `--device-memory` was given:
    the option is that budget now (exit 0); without either, the one line still names the key."""
    moe = str(Path(TINY).with_name("internlm2_tiny_moe.py"))
    options = [*SMALL, "parallel.mode='ddp'", "parallel.expert.size=auto"]
    argv = ["--config", moe, "--world-size", "2", "--check-only", "--cfg-options", *options]
    assert plan.main(argv) == 2
    assert "parallel.expert.size='auto' needs memory_budget.device" in capsys.readouterr().err
    assert plan.main([*argv, "--device-memory", "1GiB"]) == 0
    assert "configs/internlm2_tiny_moe.py on 2 rank(s): fits" in capsys.readouterr().out
