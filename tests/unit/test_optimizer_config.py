"""The `optimizer` section: a shared learning-rate spelling beside InternEvo's `adam.lr`, and update rules chosen
per parameter by name pattern."""

from typing import Any

import pytest
import torch

from internlm_offload.builder.optimizer import run_param_groups
from internlm_offload.config import ConfigError, resolve_config
from internlm_offload.optim import param_groups


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
    assert "optimizer.rules" in config_error({"optimizer": {"rules": [["*", "muon"]]}})


def test_adamw_patterns_leave_the_run_s_groups_as_they_were() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    cfg = resolve_config({"optimizer": {"rules": [["0.*", "adamw"]]}})
    got, want = run_param_groups(cfg, model), param_groups(model, cfg.adam.weight_decay)
    assert [{k: v for k, v in g.items() if k != "params"} for g in got] == [
        {k: v for k, v in g.items() if k != "params"} for g in want
    ]
    assert [[id(p) for p in g["params"]] for g in got] == [[id(p) for p in g["params"]] for g in want]
