"""`tools.export`: a checkpoint's weights as consolidated safetensors, and as a loadable HF folder."""

import subprocess
import sys

import pytest
import torch
from runner import REPO, run_python, train

from internlm_offload.tools.export import load_weights

pytestmark = pytest.mark.e2e


def export(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "internlm_offload.tools.export", *map(str, args)]
    return run_python(cmd)


def test_fsdp2_checkpoint_exports_to_a_folder_transformers_loads(tmp_path):
    run = tmp_path / "run"
    train(
        run,
        "data.total_steps=2",
        "parallel.mode=fsdp2",
        "model.dtype=torch.bfloat16",
        nproc=2,
        config=REPO / "configs" / "hf_llama_tiny.py",
    )
    out = tmp_path / "hf"
    proc = export(run / "checkpoints", out, "--hf")
    assert proc.returncode == 0, proc.stderr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    weights = load_weights(run / "checkpoints" / "step_00000002")  # the fp32 masters, resharded to one process
    loaded = model.state_dict()
    assert len(loaded) == len(weights)
    for name, tensor in weights.items():
        assert torch.equal(loaded[name.removeprefix("hf_model.")], tensor), name
    assert all(t.dtype == torch.float32 for t in weights.values())


@pytest.fixture(scope="module")
def native_run(reference_run):
    """The tiny config's run of 2 steps (its checkpoint of step 2), trained once for the tests below: read only."""
    return reference_run("data.total_steps=2")


def test_internlm2_checkpoint_exports_safetensors_in_bf16(native_run, tmp_path):
    from safetensors.torch import load_file

    run = native_run
    out = tmp_path / "weights.safetensors"
    assert export(run / "checkpoints", out, "--dtype", "bfloat16").returncode == 0
    tensors = load_file(out)
    weights = load_weights(run / "checkpoints" / "step_00000002")
    assert tensors.keys() == weights.keys()
    assert all(torch.equal(tensors[k], weights[k].to(torch.bfloat16)) for k in weights)


@pytest.mark.parametrize("case", ["missing", "not_safetensors", "tp_without_internevo"])
def test_bad_export_input_is_one_line_exit_2(request, tmp_path, case):
    if case == "missing":
        proc = export(tmp_path / "nope", tmp_path / "w.safetensors")
        part = "checkpoint not found"
    else:
        run = request.getfixturevalue("native_run")  # a good checkpoint, exported with bad arguments
        if case == "not_safetensors":
            proc, part = export(run / "checkpoints", tmp_path / "w.bin"), "must end in .safetensors"
        else:
            proc, part = export(run / "checkpoints", tmp_path / "hf", "--hf", "--tp", "2"), "pass --internevo"
    assert proc.returncode == 2 and part in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
