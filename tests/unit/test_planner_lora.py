"""The planner on a LoRA run (docs/lora.md "The planner"): the frozen base's host tier is a knob of the search,
priced at the base's own dtype and streamed a block at a time."""

from internlm_offload.builder.model import build_probe_model
from internlm_offload.config import load_config_file, resolve_config
from internlm_offload.planner.knobs import PARAMS_ON_HOST, WRAPPER, optimizer_settings
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
