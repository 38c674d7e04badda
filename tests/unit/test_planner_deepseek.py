"""The planner on the DeepSeek-V3 lineage (model.type="deepseek_v3", docs/deepseek.md): a step composed from reduced
models that keep both kinds of blocks (dense-first and sparse), the folder's model planned (its config.json's blocks
and experts, not the model section's defaults), MLA's attention as the planned device runs it, and the frozen experts
of a LoRA run under expert parallel in the compute dtype."""

import json
from pathlib import Path

import pytest
import torch

from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.family import block_kinds, family_spec, with_blocks
from internlm_offload.planner.compose import Tracer, block_runs, trace_composed
from internlm_offload.planner.trace import trace_step

pytestmark = pytest.mark.usefixtures("shared_traces")

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# 2 dense-first blocks, 7 sparse ones (8 experts, top-2 in 1 of 2 groups, a shared expert); MLA with v's head dim (8)
# apart from q/k's (16)
HF = {
    "model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 9, "first_k_dense_replace": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "vocab_size": 259,
}  # fmt: skip
SHAPE = {"data.seq_len": 64, "data.micro_bsz": 2, "data.micro_num": 2, "data.global_bsz": None}
OFFLOAD = {"cpu_offloading.enable": True}


def config(options=None, world_size=1, hf=None):
    raw = load_config_file(CONFIGS / "deepseek_v3_tiny.py", {**SHAPE, **(options or {})})
    raw["model"]["hf_config"] = hf or HF
    return resolve_config(raw, world_size=world_size)


def blocks_of(cfg) -> int:
    """The blocks a (reduced) config builds: its config.json's."""
    return cfg.model.hf_config["num_hidden_layers"]


def close(composed: int, whole: int) -> bool:
    return abs(composed - whole) <= 0.005 * abs(whole)


CASES = {
    "offload 4 (2 dense, 2 sparse)": {**OFFLOAD, "cpu_offloading.num_layers": 4},
    "checkpoint 0.5": {"model.checkpoint": 0.5},
    "fsdp2 x1 + checkpoint 1.0": {"parallel.mode": "fsdp2", "model.checkpoint": 1.0},
}


@pytest.mark.parametrize("name", CASES)
def test_a_dense_first_model_composes_from_reduced_models_of_both_kinds(name):
    """Runs of blocks with one plan and one kind: the reduced models keep the dense-first blocks before the sparse
    ones (the family's `with_blocks`), none has the 9 blocks, and the composed step is the whole model's trace within
    0.5 % (peaks, every component, the per-block figures, the work)."""
    cfg = config(CASES[name])
    reduced = []

    def traced(c, count_work):
        reduced.append(c)
        return trace_step(c, count_work=count_work)

    composed, whole = trace_composed(cfg, trace=traced), trace_step(cfg)
    assert reduced and all(blocks_of(c) < 9 for c in reduced), [blocks_of(c) for c in reduced]
    assert all(block_kinds(c.model)[:2] == ("dense", "dense") for c in reduced)
    for key in ("device_peak_bytes", "host_peak_bytes", "first_step_device_peak_bytes"):
        assert close(getattr(composed, key), getattr(whole, key)), (key, getattr(composed, key), getattr(whole, key))
    for key, value in whole.components.items():
        assert close(composed.components[key], value), (key, composed.components[key], value)
    for part in ("micro_batch_work", "optimizer_work"):
        for key, value in vars(getattr(whole, part)).items():
            assert close(getattr(getattr(composed, part), key), value), (part, key)
    assert len(composed.block_activation_bytes) == 9
    assert all(close(a, b) for a, b in zip(composed.block_activation_bytes, whole.block_activation_bytes))


def test_runs_are_cut_where_the_kind_changes():
    """Offloading 4 of the 9 blocks: the 2 offloaded dense blocks, 2 offloaded sparse ones, 5 plain sparse ones."""
    runs = block_runs(config({**OFFLOAD, "cpu_offloading.num_layers": 4}))
    assert [(mode.value, kind, n) for (mode, kind), n in runs] == [
        ("offload", "dense", 2),
        ("offload", "sparse", 2),
        ("plain", "sparse", 5),
    ]


def test_the_family_names_its_blocks_kinds_and_builds_any_sequence_of_them():
    """DeepSeek-V3's dense-first count (transformers' default 3 where config.json leaves it out), GLM-4.7-Flash's
    mlp_layer_types; `with_blocks` builds exactly the kinds asked for, in order (what the reduced models and the kernel
    probe are built from)."""
    section = config().model
    assert block_kinds(section) == ("dense",) * 2 + ("sparse",) * 7
    default = {k: v for k, v in HF.items() if k != "first_k_dense_replace"}
    assert block_kinds(config(hf=default).model)[:4] == ("dense",) * 3 + ("sparse",)
    lite = {**default, "model_type": "glm4_moe_lite", "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}
    assert block_kinds(config(hf={**lite, "num_hidden_layers": 4}).model) == ("dense", "sparse", "dense", "sparse")
    probe = with_blocks(section, ["dense", "sparse"])
    model = family_spec("deepseek_v3")(probe, torch.device("meta"))
    assert [type(layer.feed_forward).__name__ for layer in model.layers] == ["FeedForward", "MoE"]


def test_the_kernel_probe_runs_one_block_of_each_kind(monkeypatch):
    """A deepseek_v3 run's kernel probe (launch.probe_kernel_memory) runs a dense and a sparse block: without it the
    kernels' own memory (2.8 MiB on the tiny config) showed in the step readings, -7.9 % against the prediction."""
    from internlm_offload import launch
    from internlm_offload.engine import runtime_memory

    built = []
    monkeypatch.setattr(runtime_memory, "kernel_memory", lambda accelerator, make, *args: built.append(make()) or 7)
    assert launch.probe_kernel_memory(config(), accelerator=None) == 7
    assert [type(layer.feed_forward).__name__ for layer in built[0].layers] == ["FeedForward", "MoE"]


def write_folder(folder: Path) -> Path:
    """A DeepSeek-V3-shaped folder holding config.json alone: 61 blocks (3 dense-first), 256 experts top-8 in 4 of 8
    groups, at tiny widths."""
    folder.mkdir()
    layout = {"num_hidden_layers": 61, "first_k_dense_replace": 3, "n_routed_experts": 256, "num_experts_per_tok": 8}
    (folder / "config.json").write_text(json.dumps({**HF, **layout, "n_group": 8, "topk_group": 4}))
    return folder


def test_a_plan_is_of_the_folders_model(tmp_path, monkeypatch, capsys):
    """model.hf_path naming a folder with a config.json and no weights: tools.plan plans its 61 blocks and 256
    experts top-8, not the model section's default 4 blocks (its search offers offloading 30 and 60 of them, its
    routing line counts 256 experts; before, no routing line: the section's model.num_experts is 0), and a
    memory_budget run's "auto" knobs likewise; the step is composed from reduced models of both kinds."""
    from internlm_offload.planner import auto, search
    from internlm_offload.tools import plan

    folder = write_folder(tmp_path / "deepseek_v3")
    path = tmp_path / "plan.py"
    path.write_text(
        f"_base_ = [{str(CONFIGS / 'deepseek_v3_tiny.py')!r}]\n"
        f"model = dict(_delete_=True, type='deepseek_v3', hf_path={str(folder)!r}, dtype='torch.float32')\n"
    )
    spaces = []

    def searched(config_for, space, *args, **kwargs):
        spaces.append(space)
        return None, [], []

    monkeypatch.setattr(search, "search_space", searched)
    monkeypatch.setattr(search, "smallest_peak", lambda *args: "")
    out = tmp_path / "plan.json"
    options = [f"{key}={value}" for key, value in SHAPE.items()]
    assert plan.main(["--config", str(path), "--cfg-options", *options, "--device-memory", "1GiB", "--json", str(out)])
    report = json.loads(out.read_text())
    cfg = resolve_config(load_config_file(path, SHAPE))
    built = family_spec("deepseek_v3")(cfg.model, torch.device("meta"))
    assert len(built.layers) == 61 and built.layers[3].feed_forward.num_experts == 256
    assert len(report["block_activation_bytes"]) == 61
    assert report["components"]["model_params"] == 4 * sum(p.numel() for p in built.parameters())
    assert spaces[0].num_layers == 61
    printed = capsys.readouterr().out
    assert "mixture of experts: 256 experts, top-8, Dropless: 1024 routed rows" in printed
    # train.py's "auto" knobs search the same blocks
    monkeypatch.setattr(auto, "search_space", searched)
    monkeypatch.setattr(auto, "hardware_for", lambda name: None)
    monkeypatch.setattr(auto, "smallest_peak", lambda *args: "")
    budget = {**SHAPE, "memory_budget.device": "1GiB", "cpu_offloading.num_layers": "auto"}
    auto_cfg = resolve_config(load_config_file(path, budget))
    with pytest.raises(auto.PreflightError):
        auto.choose_auto_knobs(auto_cfg, None, accelerator_name="cpu")
    assert spaces[1].num_layers == 61


def test_composing_the_folders_model_traces_no_61_block_model():
    """The 61-block folder is traced as models of 5 and 6 blocks (3 dense, 2 or 3 sparse), composed to 61."""
    tracer = Tracer()
    cfg = config(hf={**HF, "num_hidden_layers": 61, "first_k_dense_replace": 3})
    memory = tracer.step(cfg)
    assert len(memory.block_activation_bytes) == 61
    assert sorted(json.loads(key)["model"]["hf_config"]["num_hidden_layers"] for key, _ in tracer._done) == [5, 6]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_latent_attention_is_traced_with_the_planned_devices_kernel(device):
    """MLA's values have another head dim than its queries, which no flash kernel takes: cpu runs SDPA's math path and
    saves B x H x T x T attention weights per block (quadratic in the sequence), a device its memory-efficient kernel,
    which saves q, k, v, the output and a log-sum-exp (linear). `device` in the config says which."""
    per_block = {}
    for seq_len in (64, 128):
        memory = trace_step(config({"device": device, "data.seq_len": seq_len}), count_work=False)
        per_block[seq_len] = memory.block_activation_bytes[-1]  # a sparse block's
    # what doubling the sequence adds beyond twice the saved bytes: one B x H x T x T fp32 tensor's quadratic part
    quadratic = 2 * 2 * (128 * 128 - 2 * 64 * 64) * 4
    beyond = per_block[128] - 2 * per_block[64]
    assert abs(beyond - (0 if device == "cuda" else quadratic)) < 1024, (beyond, quadratic)


def test_a_lora_base_under_expert_parallel_keeps_its_experts_in_the_compute_dtype():
    """LoRA over a bf16 base under FSDP2 with expert parallel: each rank's frozen experts (4 of 8) are bf16, 2 bytes
    each (engine/precision.cast_frozen: `.data =` on a DTensor parameter changed its dtype, not its local shard's,
    which stayed fp32: 4 bytes each, twice the host memory of the 671B LoRA plan)."""
    options = {
        "model.dtype": "torch.bfloat16",
        "model.lora.r": 4,
        "model.lora.target_modules": ["q_a_proj", "o_proj"],
        "parallel.mode": "fsdp2",
        "parallel.expert.size": 2,
        "model.mtp_config": {"num_layers": 0},  # multi-token prediction is refused under LoRA
    }
    memory = trace_step(config(options, world_size=2), 2, count_work=False)
    experts = 7 * 8 * 3 * 64 * 32  # sparse blocks x experts x (gate, up, down) x hidden x expert width
    assert memory.components["expert_params"] == 2 * experts // 2


def test_traces_sharing_sharding_decisions_read_the_same_and_leave_none_behind():
    """A search's traces share DTensor's cached sharding decisions (FSDP2 and expert parallel over one fake mesh
    shape): a trace inside makes no decision anew that the one before made, reads what it reads alone, and the
    context leaves the cache empty for the run after it (clearing it resets its counts)."""
    from torch.distributed.tensor.debug import _get_fast_path_sharding_prop_cache_stats as hits_and_misses

    from internlm_offload.planner import trace

    options = {"parallel.mode": "fsdp2", "parallel.expert.size": 2, "model.checkpoint": 0.5}
    cfg = config(options, world_size=2)
    alone = trace.trace_step(cfg, 2, count_work=False).as_dict()
    assert hits_and_misses() == (0, 0)  # a trace alone clears the cache as it ends
    with trace.shared_sharding_decisions():
        trace.trace_step(cfg, 2, count_work=False)
        first = hits_and_misses()
        shared = trace.trace_step(cfg, 2, count_work=False).as_dict()
        second = hits_and_misses()
    assert first[1] > 0 and second[1] == first[1] and second[0] > first[0]  # decided once, then read
    assert hits_and_misses() == (0, 0)
    assert shared == alone
