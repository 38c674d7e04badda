"""LoRA through train.py (docs/lora.md): the shipped config fine-tunes the baseline's checkpoint; its checkpoints hold
the adapters only and a resume (which loads the base again) is bitwise; DDP and FSDP2 (base shards on the host by
FSDP2's CPU offload policy) on two processes follow the one-process run."""

import json
import math
import shutil

import pytest
from runner import REPO, losses, metrics, train

pytestmark = pytest.mark.e2e

CONFIG = REPO / "configs" / "internlm2_tiny_lora.py"
STEPS = ["data.total_steps=6", "data.global_bsz=8", "ckpt.checkpoint_every=3", "ckpt.keep_last=0"]


def lora_options(base: str) -> list[str]:
    """Fine-tune the baseline's last checkpoint (fp32 weights; the frozen base is held in bf16)."""
    return [*STEPS, f"ckpt.load_ckpt_info.path={base}"]


@pytest.fixture(scope="module")
def base(baseline) -> str:
    return str(baseline("none") / "checkpoints")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base):
    run = tmp_path_factory.mktemp("lora")
    train(run, *lora_options(base), config=CONFIG)
    return run


def test_checkpoints_hold_the_adapters_and_name_the_base(lora_run, base):
    step = lora_run / "checkpoints" / "step_00000006"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["model"] and all(".lora_A." in k or ".lora_B." in k for k in manifest["model"])
    assert losses(lora_run)[1] < 4.5  # B = 0: step 1 is the trained base's loss (a fresh model's is ln 259 = 5.56)
    import torch

    config = torch.load(step / "train_state.pt", weights_only=True)["config"]
    assert config["ckpt"]["load_ckpt_info"]["path"] == base and config["model"]["lora"]["r"] == 8


def test_resume_loads_the_base_again_and_is_bitwise(lora_run, base, tmp_path):
    shutil.copytree(lora_run / "checkpoints" / "step_00000003", tmp_path / "checkpoints" / "step_00000003")
    train(tmp_path, *lora_options(base), config=CONFIG, resume=True)
    expected = [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in metrics(lora_run) if r["step"] > 3]
    assert [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in metrics(tmp_path)] == expected


@pytest.mark.dist
@pytest.mark.parametrize(
    "mode, options",
    [("ddp", ["parallel.mode=ddp"]), ("fsdp2", ["parallel.mode=fsdp2", "parallel.fsdp_cpu_offload=True"])],
)
def test_two_processes_follow_one(lora_run, base, tmp_path, mode, options):
    """Same global batch: the losses equal up to float summation order (bf16 forward; the loss averaged over ranks)."""
    train(tmp_path, *lora_options(base), *options, config=CONFIG, nproc=2)
    one, two = losses(lora_run), losses(tmp_path)
    assert two.keys() == one.keys()
    for step, loss in one.items():
        assert math.isclose(two[step], loss, rel_tol=1e-5), (mode, step, two[step], loss)
