"""The native model's Qwen attention options through train.py and `tools.export --hf`: an explicit head_dim exports
to a Llama folder transformers loads; what Llama cannot hold (q, k, v biases apart from o's, q/k norms, experts)
is refused in one line."""

import subprocess
import sys

import pytest
import torch
from runner import run_python, train

from internlm_offload.tools.export import load_weights

pytestmark = pytest.mark.e2e
ONE_STEP = ["data.total_steps=1"]


def export(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "internlm_offload.tools.export", *map(str, args)]
    return run_python(cmd)


def test_a_head_dim_apart_from_hidden_over_heads_exports_to_llama(tmp_path):
    run = tmp_path / "run"
    train(run, *ONE_STEP, "model.head_dim=48")  # hidden 128 / 4 heads would be 32
    out = tmp_path / "hf"
    proc = export(run / "checkpoints", out, "--hf")
    assert proc.returncode == 0, proc.stderr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    assert model.config.head_dim == 48
    weights = load_weights(run / "checkpoints" / "step_00000001")
    loaded = model.state_dict()
    assert loaded["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 48, 128)
    assert torch.equal(loaded["model.layers.0.self_attn.q_proj.weight"], weights["layers.0.attention.wq.weight"])


@pytest.mark.parametrize(
    "options, part",
    [
        (["model.qkv_bias=True", "model.o_bias=False"], "model.qkv_bias=True with model.o_bias=False"),
        (["model.qk_norm=True"], "q_norm"),  # no Llama name for its weights
    ],
)
def test_what_llama_cannot_hold_is_refused(tmp_path, options, part):
    run = tmp_path / "run"
    train(run, *ONE_STEP, *options)
    proc = export(run / "checkpoints", tmp_path / "hf", "--hf")
    assert proc.returncode == 2 and part in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
