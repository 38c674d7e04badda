"""The planner on a LoRA run (docs/lora.md "The planner"): the frozen base's host tier is a knob of the search,
priced at the base's own dtype and streamed a block at a time."""

from internlm_offload.builder.model import build_probe_model
from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.planner.compose import Tracer
from internlm_offload.planner.cost import HARDWARE
from internlm_offload.planner.knobs import BASE_ON_HOST as BASE_ON_HOST_KNOB
from internlm_offload.planner.knobs import PARAMS_ON_HOST, WRAPPER, Setting, optimizer_settings
from internlm_offload.planner.search import candidate_configs, search
from internlm_offload.planner.trace import trace_step

CONFIG = "configs/internlm2_tiny_lora.py"  # bf16, r=8 on all seven projections
BASE_ON_HOST = {"parallel.mode": "fsdp2", PARAMS_ON_HOST: True}


def frozen_and_adapter_elements(cfg) -> tuple[int, int]:
    model = build_probe_model(cfg.model)  # the run's model on meta, adapters included
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return frozen, sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_a_lora_search_offers_the_base_on_the_host() -> None:
    """A LoRA config that leaves the wrapper open is offered FSDP2's CPU offload policy, switching to FSDP2."""
    cfg = resolve_config(load_config_file(CONFIG, {}))
    settings = {s.name: s.options for s in optimizer_settings(cfg, free_wrapper=True)}
    assert settings["params on host (FSDP2)"][PARAMS_ON_HOST] is True
    assert settings["params on host (FSDP2)"][WRAPPER] == "fsdp2"
    # with the trainer's own base on the host, FSDP2's is not offered: the two do not compose (a config error)
    hosted = resolve_config(load_config_file(CONFIG, {"model.lora.base_on_host": True}))
    assert "params on host (FSDP2)" not in {s.name for s in optimizer_settings(hosted, free_wrapper=True)}


def test_the_base_on_the_host_is_priced_at_its_dtype_and_streamed_per_block() -> None:
    """On the host: the bf16 base (2 B a parameter, no master) beside the adapters' fp32 shards and AdamW states;
    on the device none of it at rest. Each micro-batch copies the base in at bf16 twice (forward, and backward's
    re-gather), which is what the cost model charges to the link."""
    cfg = resolve_config(load_config_file(CONFIG, BASE_ON_HOST))
    frozen, adapters = frozen_and_adapter_elements(cfg)
    plan = trace_step(cfg)
    parts = plan.components
    assert parts["host_params"] == 2 * frozen + 4 * adapters
    assert parts["host_optimizer_states"] == 8 * adapters
    assert parts["model_params"] == parts["master_weights"] == 0
    assert plan.micro_batch_work.h2d_bytes == 2 * (2 * frozen) + 4 * adapters
    on_device = trace_step(resolve_config(load_config_file(CONFIG, {"parallel.mode": "fsdp2"})))
    assert on_device.micro_batch_work.h2d_bytes == 0
    assert on_device.components["model_params"] >= 2 * frozen  # the same base, on the device
    assert plan.device_peak_bytes < on_device.device_peak_bytes - 2 * frozen * 3 // 4


def test_the_base_is_counted_at_its_compute_dtype_without_master_gradient_or_state() -> None:
    """The LoRA run on the device: params are the bf16 base and the adapters' bf16 copies; masters, gradients
    and AdamW states are the adapters' only."""
    cfg = resolve_config(load_config_file(CONFIG, {}))
    frozen, adapters = frozen_and_adapter_elements(cfg)
    parts = trace_step(cfg).components
    assert parts["model_params"] == 2 * (frozen + adapters)
    assert parts["master_weights"] == 4 * adapters
    assert 0 <= parts["optimizer_states"] - 8 * adapters < 1024  # two fp32 states, and AdamW's step counters
    assert parts["gradients_at_step"] == 4 * adapters


def test_the_trainers_own_base_on_the_host_is_traced() -> None:
    """`model.lora.base_on_host` under parallel.mode none: the trace runs the trainer's own `HostedBase`, so the
    blocks' frozen linears are pinned host memory at bf16, the device keeps the rest of the base, and each
    micro-batch brings 2 L - 3 blocks in (forward blocks 1..L-1, block 0 being left from the last backward; backward
    blocks L-3..0, the top two being left from forward's turn): what the cost model charges to the link."""
    from internlm_offload.offload.hosted_base import frozen_linears

    cfg = resolve_config(load_config_file(CONFIG, {"parallel.mode": "none", "model.lora.base_on_host": True}))
    frozen, adapters = frozen_and_adapter_elements(cfg)
    blocks = [frozen_linears(block) for block in build_probe_model(cfg.model).layers]
    block_bytes = {sum(2 * p.numel() for linear in block for p in linear.parameters()) for block in blocks}
    (per_block,) = block_bytes  # every block alike
    plan = trace_step(cfg)
    parts = plan.components
    assert parts["host_params"] == parts["pinned_host_peak"] == len(blocks) * per_block
    assert parts["model_params"] == 2 * (frozen + adapters) - len(blocks) * per_block
    assert plan.micro_batch_work.h2d_bytes == (2 * len(blocks) - 3) * per_block
    on_device = trace_step(resolve_config(load_config_file(CONFIG, {"parallel.mode": "none"})))
    # block 0's copy, kept from backward for the next forward
    assert parts["other_at_rest"] - on_device.components["other_at_rest"] == per_block
    drop = on_device.device_peak_bytes - plan.device_peak_bytes
    assert len(blocks) * per_block - 2 * per_block <= drop <= len(blocks) * per_block


def test_the_trainers_base_on_the_host_is_a_knob_where_it_is_built() -> None:
    """`model.lora.base_on_host="auto"`: each optimizer setting that keeps the wrapper none or DDP is offered with the
    base on the host too; not beside FSDP2 (its own policy holds the base there), nor where it is not built."""
    budget = {"memory_budget.device": "1GiB", BASE_ON_HOST_KNOB: "auto"}
    cfg = resolve_config(load_config_file(CONFIG, budget))
    assert BASE_ON_HOST_KNOB in cfg.auto_knobs and cfg.model.lora.base_on_host is False
    settings = {s.name: s.options for s in optimizer_settings(cfg, cfg.auto_knobs)}
    assert settings == {"optimizer as configured": {BASE_ON_HOST_KNOB: False}, "optimizer as configured + base on host":
                        {BASE_ON_HOST_KNOB: True}}  # fmt: skip
    everything = {s.name: s.options for s in optimizer_settings(cfg, free_wrapper=True)}  # tools.plan's search
    assert everything["swap + grad offload + base on host"][BASE_ON_HOST_KNOB] is True
    assert everything["params on host (FSDP2)"][BASE_ON_HOST_KNOB] is False
    assert "params on host (FSDP2) + base on host" not in everything
    fsdp2 = resolve_config(load_config_file(CONFIG, {**budget, "parallel.mode": "fsdp2"}))
    assert optimizer_settings(fsdp2, fsdp2.auto_knobs) == [Setting("optimizer as configured", {})]


def test_the_search_holds_the_base_on_the_host_where_the_device_cannot() -> None:
    """At a device budget between the base on the host's traced peak and the base on the device's, the search's
    choice (composed estimates, then the whole trace) holds it on the host."""
    options = {"parallel.mode": "none", "model.checkpoint": 1.0, "data.seq_len": 32, "model.num_layers": 3}
    raw = load_config_file(CONFIG, options)
    config_for, tracer = candidate_configs(raw), Tracer()  # each config traced once, here and in the search
    optimizers = optimizer_settings(config_for({}), {BASE_ON_HOST_KNOB})
    on_device = tracer.whole(config_for({BASE_ON_HOST_KNOB: False}), count_work=True).device_peak_bytes
    hosted = tracer.whole(config_for({BASE_ON_HOST_KNOB: True}), count_work=True)
    budget = (on_device + hosted.device_peak_bytes) // 2
    only = [Setting("", {})]
    chosen, candidates = search(config_for, only, optimizers, HARDWARE["h100"], budget, None, tracer=tracer)
    assert tracer.traces == 2
    assert [c.verdict.split(" ")[0] for c in candidates] == ["estimated", "chosen"]  # the copies cost time
    assert chosen.options == {BASE_ON_HOST_KNOB: True}
    assert chosen.memory.device_peak_bytes == hosted.device_peak_bytes
