"""LoRA through train.py (docs/lora.md): the shipped config fine-tunes the baseline's checkpoint; its checkpoints hold
the adapters only and a resume (which loads the base again) is bitwise; DDP and FSDP2 (base shards on the host by
FSDP2's CPU offload policy) and a two-stage pipeline on two processes follow the one-process run."""

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


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, base):
    run = tmp_path_factory.mktemp("lora_ddp")
    train(run, *lora_options(base), "parallel.mode=ddp", config=CONFIG, nproc=2)
    return run


@pytest.mark.dist
@pytest.mark.parametrize(
    "mode, options",
    [("ddp", ["parallel.mode=ddp"]), ("fsdp2", ["parallel.mode=fsdp2", "parallel.fsdp_cpu_offload=True"])],
)
def test_two_processes_follow_one(lora_run, base, tmp_path, request, mode, options):
    """Same global batch: the losses equal up to float summation order (bf16 forward; the loss averaged over ranks)."""
    if mode == "ddp":
        run = request.getfixturevalue("ddp_run")  # shared with the base-on-host comparison below
    else:
        run = tmp_path
        train(run, *lora_options(base), *options, config=CONFIG, nproc=2)
    one, two = losses(lora_run), losses(run)
    assert two.keys() == one.keys()
    for step, loss in one.items():
        assert math.isclose(two[step], loss, rel_tol=1e-5), (mode, step, two[step], loss)


@pytest.mark.dist
def test_pipeline_stages_follow_one_process_and_save_the_adapters_only(lora_run, base, tmp_path):
    """`parallel.pipeline.size=2` (1F1B, two blocks a stage): each stage carries its blocks' adapters. The losses
    follow the one-process run within 1e-5 (bf16: a stage's micro-batch gradients add up in bf16 before its fp32
    masters take them, as every bf16 pipeline here does), the checkpoints hold the adapters only, by the
    one-process names, and `--peft` exports them."""
    from internlm_offload.engine.checkpoint_reader import read_metadata
    from internlm_offload.tools.export import main as export

    train(tmp_path / "run", *lora_options(base), "parallel.pipeline.size=2", config=CONFIG, nproc=2)
    one, two = losses(lora_run), losses(tmp_path / "run")
    assert two.keys() == one.keys()
    assert all(math.isclose(two[step], loss, rel_tol=1e-5) for step, loss in one.items()), (one, two)
    names = {
        checkpoint: sorted(k for k in read_metadata(checkpoint).state_dict_metadata if k.startswith("model."))
        for checkpoint in (
            lora_run / "checkpoints" / "step_00000006",
            tmp_path / "run" / "checkpoints" / "step_00000006",
        )
    }
    ((_, single), (_, staged)) = names.items()
    assert staged == single and all(".lora_A." in k or ".lora_B." in k for k in staged)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000006"
    assert export([str(checkpoint), str(tmp_path / "adapter"), "--peft"]) == 0


@pytest.mark.dist
def test_qlora_under_ddp_with_its_4bit_base_on_the_host_follows_one_process(tmp_path):
    """QLoRA (`configs/internlm2_tiny_qlora.py`, nf4, shrunk to 2 blocks of width 64) on 2 DDP processes with the
    packed base and its scales on the host follows the one-process QLoRA run with its base on the device, same
    global batch, within 1e-5 (bitwise when written): DDP leaves the packed base and its scales to each rank (each
    quantizes the same weights) and reduces the adapters only."""
    pytest.importorskip("bitsandbytes")
    small = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "data.seq_len=32"]
    options = [*small, "data.total_steps=3", "data.global_bsz=8", "ckpt.enable_save_ckpt=False"]
    qlora = REPO / "configs" / "internlm2_tiny_qlora.py"
    train(tmp_path / "one", *options, config=qlora)
    hosted = ["parallel.mode=ddp", "model.lora.base_on_host=True"]
    proc = train(tmp_path / "ddp", *options, *hosted, config=qlora, nproc=2)
    # the packed weights and the scales (buffers DDP would broadcast before every forward) are left to each rank:
    # 14 linears x (the packed weight, absmax, code and double quantization's absmax2, code2, offset)
    assert "Applied DDP over 2 ranks (bucket 25 MB), 84 frozen base tensors apart" in proc.stderr
    assert "LoRA base on the host" in proc.stderr
    one, two = losses(tmp_path / "one"), losses(tmp_path / "ddp")
    assert two.keys() == one.keys() and len(set(one.values())) == 3
    assert all(math.isclose(two[step], loss, rel_tol=1e-5) for step, loss in one.items()), (one, two)


@pytest.mark.dist
def test_ddp_with_the_base_on_the_host_is_bitwise_ddp(ddp_run, base, tmp_path):
    """`model.lora.base_on_host=True` under DDP on two processes: only bytes move, so every step's loss and grad
    norm are DDP's own, bitwise; the frozen block linears were on the host (the run's metrics count them)."""
    proc = train(
        tmp_path, *lora_options(base), "parallel.mode=ddp", "model.lora.base_on_host=True", config=CONFIG, nproc=2
    )
    assert "LoRA base on the host" in proc.stderr
    fields = ("step", "loss", "grad_norm")
    records = metrics(tmp_path)
    assert [[r[f] for f in fields] for r in records] == [[r[f] for f in fields] for r in metrics(ddp_run)]
    assert all(r["base_on_host_bytes"] > 0 for r in records)


def test_export_rebuilds_the_base_from_the_checkpoint_it_names(lora_run, baseline, tmp_path):
    """--hf of the LoRA checkpoint writes the base it named (the baseline's weights, bitwise); PEFT's adapter folder
    on that base gives the merged export's logits (fp32, within 1e-5)."""
    import peft
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from internlm_offload.tools.export import main as export

    lora = str(lora_run / "checkpoints")
    for args, out in (([lora], "base"), ([lora, "--peft"], "adapter"), ([lora, "--merge"], "merged")):
        flags = [] if out == "adapter" else ["--hf"]
        assert export([*args, str(tmp_path / out), *flags]) == 0
    assert export([str(baseline("none") / "checkpoints"), str(tmp_path / "baseline"), "--hf"]) == 0
    ours, theirs = (load_file(tmp_path / name / "model.safetensors") for name in ("base", "baseline"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    tokens = torch.randint(0, 259, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
        )
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        expected = merged(input_ids=tokens).logits
        torch.testing.assert_close(adapted(input_ids=tokens).logits, expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(
            AutoModelForCausalLM.from_pretrained(tmp_path / "base")(input_ids=tokens).logits, expected
        )
