"""The `optimizer` section: a shared learning-rate spelling beside InternEvo's `adam.lr`, and update rules chosen
per parameter by name pattern."""

from pathlib import Path
from typing import Any

import pytest
import torch

from internlm_offload.builder.model import build_model
from internlm_offload.builder.optimizer import run_param_groups
from internlm_offload.builder.run import trainer_settings
from internlm_offload.config import ConfigError, load_config_file, resolve_config
from internlm_offload.optim import param_groups
from internlm_offload.optim.muon_rule import ROW_SPLITS_KEY
from internlm_offload.optim.rules import RULE_KEY

REPO = Path(__file__).resolve().parents[2]


def config_error(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_config(raw)
    message = str(info.value)
    assert "\n" not in message.strip()
    return message


def test_optimizer_lr_is_the_learning_rate_adam_lr_still_works() -> None:
    assert resolve_config({"optimizer": {"lr": 3e-4}}).adam.lr == 3e-4
    assert resolve_config({"adam": {"lr": 2e-4}}).adam.lr == 2e-4
    assert resolve_config({"optimizer": {"lr": 2e-4}, "adam": {"lr": 2e-4}}).adam.lr == 2e-4


def test_two_different_learning_rates_are_refused_in_one_line() -> None:
    message = config_error({"optimizer": {"lr": 3e-4}, "adam": {"lr": 2e-4}})
    assert "optimizer.lr=0.0003 and adam.lr=0.0002" in message


def test_rules_come_as_pairs_and_name_known_rules() -> None:
    cfg = resolve_config({"optimizer": {"rules": [["*.bias", "adamw"], ("*", "adamw")]}})  # lists, as files give
    assert cfg.optimizer.rules == [("*.bias", "adamw"), ("*", "adamw")]
    assert "optimizer.rules" in config_error({"optimizer": {"rules": [["*", "lion"]]}})


def test_adamw_patterns_leave_the_run_s_groups_as_they_were() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    cfg = resolve_config({"optimizer": {"rules": [["0.*", "adamw"]]}})
    got, want = run_param_groups(cfg, model), param_groups(model, cfg.adam.weight_decay)
    assert [{k: v for k, v in g.items() if k != "params"} for g in got] == [
        {k: v for k, v in g.items() if k != "params"} for g in want
    ]
    assert [[id(p) for p in g["params"]] for g in got] == [[id(p) for p in g["params"]] for g in want]


# ---------------------------------------------------------------- Muon: XTuner's split, its keys, its refusals


def rules_by_name(cfg: Any, model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g for g in run_param_groups(cfg, model) for p in g["params"]}


def test_muon_takes_the_matrices_adamw_the_embedding_head_norms_and_biases() -> None:
    cfg = resolve_config(load_config_file(REPO / "configs" / "internlm2_tiny_muon.py"))
    model = build_model(cfg.model, torch.device("cpu"))
    groups = rules_by_name(cfg, model)
    muon = {name for name, g in groups.items() if g.get(RULE_KEY) == "muon"}
    assert muon == {n for n, p in model.named_parameters() if p.ndim == 2} - {"tok_embeddings.weight", "output.weight"}
    assert all(RULE_KEY not in groups[n] for n in ("tok_embeddings.weight", "output.weight", "norm.weight"))
    some = groups[next(iter(muon))]
    assert some["adjust_lr_fn"] == "match_rms_adamw"  # an AdamW-tuned lr works as it is
    assert (some["lr"], some["weight_decay"]) == (cfg.adam.lr, cfg.adam.weight_decay)  # the same lr and decay
    assert groups["tok_embeddings.weight"]["weight_decay"] == cfg.adam.weight_decay
    assert some["ns_dtype"] == "torch.bfloat16"  # torch's Newton-Schulz
    own = {"lr": 0.02, "weight_decay": 0.1, "ns_dtype": "torch.float32"}
    some = rules_by_name(resolve_config({"optimizer": {"type": "muon", "muon": own}}), model)[next(iter(muon))]
    assert (some["lr"], some["weight_decay"], some["ns_dtype"]) == (0.02, 0.1, "torch.float32")
    # clipping: torch's way unless XTuner's is asked for (the trainer leaves Muon's gradients unscaled)
    assert trainer_settings(cfg).unclipped_rules == ()
    xtuner = resolve_config({"optimizer": {"type": "muon", "muon": {"clip_grad": False}}})
    assert trainer_settings(xtuner).unclipped_rules == ("muon",)


def test_muon_steps_stacked_experts_and_mla_row_blocks_apart() -> None:
    raw = load_config_file(REPO / "configs" / "deepseek_v3_tiny.py", {"optimizer": {"type": "muon"}})
    cfg = resolve_config(raw)
    model = build_model(cfg.model, torch.device("cpu"))
    groups = rules_by_name(cfg, model)
    experts = [n for n, p in model.named_parameters() if p.ndim == 3]
    assert experts and all(groups[n].get(RULE_KEY) == "muon" for n in experts)
    (heads, nope, rope, v, latent) = (4, 16, 16, 16, 32)
    q_b = next(n for n in groups if n.endswith("attention.q_b_proj.weight"))
    assert groups[q_b][ROW_SPLITS_KEY] == (nope, rope) * heads
    kv_a = q_b.replace("q_b_proj", "kv_a_proj_with_mqa")
    assert groups[kv_a][ROW_SPLITS_KEY] == (latent, rope)
    assert groups[q_b.replace("q_b_proj", "kv_b_proj")][ROW_SPLITS_KEY] == (nope, v) * heads
    router = next(n for n in groups if n.endswith("router.weight"))
    assert groups[router].get(RULE_KEY) == "muon"  # [E, hidden], as XTuner's split gives the router


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"optimizer": {"type": "muon", "muon": {"adjust_lr_fn": "spectral"}}}, "optimizer.muon.adjust_lr_fn"),
        ({"optimizer": {"type": "muon", "muon": {"ns_steps": 100}}}, "optimizer.muon.ns_steps"),
        ({"optimizer": {"type": "muon", "muon": {"ns_dtype": "torch.float16"}}}, "optimizer.muon.ns_dtype"),
        ({"optimizer": {"type": "lion"}}, "optimizer.type"),
        (
            {
                "optimizer": {"rules": [["*", "muon"]]},
                "parallel": {"mode": "fsdp2"},
                "hybrid_optimizer": {"enable": True},
            },
            "parallel.mode='fsdp2' and hybrid_optimizer",
        ),
    ],
)
def test_bad_muon_settings_are_refused_in_one_line(raw: dict[str, Any], message: str) -> None:
    assert message in config_error(raw)


def test_muon_under_sharding_without_an_offload_tier_or_with_the_swap_tier_resolves() -> None:
    assert resolve_config({"optimizer": {"type": "muon"}, "parallel": {"mode": "fsdp2"}}).optimizer.type == "muon"
    swap = {"optimizer": {"type": "muon"}, "parallel": {"mode": "fsdp2"}, "swap_optimizer": True}
    assert resolve_config(swap).swap_optimizer  # the swap tier gathers each matrix whole too
    raw = {"optimizer": {"type": "muon"}, "parallel": {"tensor": {"size": 2}, "mode": "fsdp2"}}
    assert resolve_config(raw, world_size=2).parallel.tensor.size == 2


def test_a_rule_routing_a_vector_to_muon_is_refused_in_one_line() -> None:
    cfg = resolve_config({"optimizer": {"rules": [["*", "muon"]]}})
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    with pytest.raises(ConfigError, match=r"routes 0.bias \(shape \(4,\)\) to 'muon'"):
        run_param_groups(cfg, model)


def test_the_host_preflight_counts_each_rule_s_states() -> None:
    """Muon keeps 4 bytes per element, AdamW 8: the swap tier's host check asks for what the groups hold."""
    from internlm_offload.builder.optimizer import RULES
    from internlm_offload.optim.adamw_rule import ADAMW
    from internlm_offload.optim.memory import groups_state_bytes

    adamw = resolve_config(load_config_file(REPO / "configs" / "internlm2_tiny.py"))
    muon = resolve_config(load_config_file(REPO / "configs" / "internlm2_tiny_muon.py"))
    model = build_model(muon.model, torch.device("cpu"))
    elements = sum(p.numel() for p in model.parameters())
    matrices = sum(p.numel() for g in run_param_groups(muon, model) if g.get(RULE_KEY) == "muon" for p in g["params"])
    assert groups_state_bytes(run_param_groups(adamw, model), ADAMW, RULES) == (elements, 8 * elements)
    assert groups_state_bytes(run_param_groups(muon, model), ADAMW, RULES) == (elements, 8 * elements - 4 * matrices)
