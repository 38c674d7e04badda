"""A DeepSeek-V3 family `model.hf_path` that is missing or damaged: one line naming the folder and what is wrong
(ConfigError or CheckpointError, which train.py reports as one `error:` line with exit code 2:
tests/e2e/test_bad_input.py runs the missing folder through it), never transformers' Hub error or a traceback."""

import json
from pathlib import Path

import pytest
import torch

from internlm_offload.builder.model import build_model
from internlm_offload.config import ConfigError, ModelConfig, load_config_file
from internlm_offload.errors import CheckpointError

TINY = load_config_file(Path(__file__).resolve().parents[2] / "configs" / "deepseek_v3_tiny.py")["model"]["hf_config"]


def damaged(folder: Path, kind: str) -> Path:
    """A folder with `kind` of damage (a folder that is not there for "missing")."""
    if kind == "missing":
        return folder / "no_such_model"
    folder.mkdir(exist_ok=True)
    if kind != "no_config":
        (folder / "config.json").write_text("{not json" if kind == "config_not_json" else json.dumps(TINY))
    if kind == "weights_not_safetensors":
        (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    return folder


@pytest.mark.parametrize(
    "kind, error, fragment",
    [
        ("missing", ConfigError, "is not a local directory (nothing is downloaded)"),
        ("no_config", ConfigError, "the folder has no config.json"),
        ("config_not_json", ConfigError, "no readable config.json in the folder"),
        ("no_weights", CheckpointError, "no model*.safetensors or pytorch_model*.bin weights"),
        ("weights_not_safetensors", CheckpointError, "model.safetensors: not a readable safetensors file"),
    ],
)
def test_a_missing_or_damaged_folder_is_one_line_naming_it(tmp_path, kind, error, fragment):
    folder = damaged(tmp_path / "model", kind)
    with pytest.raises(error) as raised:
        build_model(ModelConfig(type="deepseek_v3", hf_path=str(folder)), torch.device("cpu"))
    message = str(raised.value)
    assert "\n" not in message and str(folder) in message and fragment in message, message
    if error is ConfigError:
        assert message.startswith(f"model.type='deepseek_v3': model.hf_path={str(folder)!r}"), message
