"""GPT-OSS as a native family (model/families/gpt_oss; configs/gpt_oss_tiny.py: sinks, 32-token windows on the even
layers of 128-token rows, biased router and clamped-SwiGLU experts) composed with the trainer: the memory tiers
bitwise against the family's baseline (loss, grad norm and the expert loads of every step), FSDP2 on two processes
and expert parallel over them under DDP within 1e-5 of one process, and a folder made by transformers (its experts
in MXFP4, as the release ships them) trained from the folder alone; tensor parallel (msp), isp and a pipeline of 2
stages within 1e-5 of one process too."""

from pathlib import Path

import pytest
import torch
from runner import REPO, assert_same_metrics, metrics, train
from tensor_parallel_runs import assert_curves

pytestmark = pytest.mark.e2e

GPT_OSS = REPO / "configs" / "gpt_oss_tiny.py"
# 6 steps of a global batch of 8 (4 micro-batches of 2 on one process), lr 1e-3
STEPS = ["data.total_steps=6", "data.global_bsz=8", "adam.lr=1e-3", "ckpt.checkpoint_every=6", "ckpt.keep_last=0"]
KEYS = ("loss", "grad_norm", "moe_tokens_per_expert", "moe_max_load")
WITHIN = {"loss": ["--rtol", "1e-5"], "grad_norm": ["--rtol", "1e-5"]}
SELECTIVE = ["cpu_offloading.enable=True", "cpu_offloading.num_layers=1", "cpu_offloading.min_offload_bytes=0",
             "model.checkpoint=0.75", "selective_checkpoint=True", "selective_checkpoint_offload=True"]  # fmt: skip
FULL = ["cpu_offloading.enable=True", "cpu_offloading.num_layers=2", "cpu_offloading.min_offload_bytes=0",
        "model.checkpoint=0.75"]  # fmt: skip
SWAP = ["swap_optimizer=True", "grad_offload=True", "grad_offload_bucket_mb=0.25", "nvme_offload.enable=True"]
HYBRID = ["hybrid_optimizer.enable=True", "hybrid_optimizer.offload_fraction=0.5"]


DTYPES = {"fp32": "torch.float32", "bf16": "torch.bfloat16"}  # bf16: fp32 masters (model/precision defaults)


@pytest.fixture(scope="module")
def baseline(reference_run) -> Path:
    """The family's fp32 run of STEPS on one process."""
    return reference_run(*STEPS, nproc=1, config=GPT_OSS)


# each tier in one precision, each precision once: the optimizer tiers under both precisions on one family are
# test_deepseek_tiers_e2e.py's; what is GPT-OSS's own (sinks, windows, biased experts) goes through both here
@pytest.mark.parametrize(
    ("tiers", "dtype"),
    [
        pytest.param([*SELECTIVE, *SWAP], "bf16", id="selective-offload-swap-gradoffload-nvme-bf16"),
        pytest.param([*FULL, *HYBRID], "fp32", id="offload-full-checkpoint-hybrid-fp32"),
    ],
)
def test_tiers_change_no_bits(tmp_path, reference_run, tiers, dtype):
    """Activation offload (every saved tensor, the sinks' probabilities and the window masks' users included) with
    selective checkpointing, the swap optimizer with its states on "NVMe" and the gradients on the host, in bf16 with
    fp32 masters; or with full checkpointing and the hybrid optimizer in fp32: every step's loss, grad norm and expert
    loads the baseline's bit for bit (the sinks' softmax in fp32 either way)."""
    precision = f"model.dtype={DTYPES[dtype]}"
    baseline = reference_run(*STEPS, *([precision] if dtype != "fp32" else []), nproc=1, config=GPT_OSS)
    run, nvme = tmp_path / "run", tmp_path / "nvme"
    nvme.mkdir()
    train(run, *STEPS, precision, *tiers, f"nvme_offload.path={nvme}", config=GPT_OSS)
    assert metrics(run)[-1]["act_offload_offloaded_bytes"] > 0
    assert_same_metrics(baseline, run, KEYS)


# DDP alone is not a case of its own: under expert parallel DDP still reduces every weight but the experts' (the
# sinks, attention, router and its bias), and plain DDP on a family is torch's DDP on every weight
@pytest.mark.parametrize(
    "layout", [["parallel.mode=fsdp2"], ["parallel.mode=ddp", "parallel.expert.size=2"]], ids=["fsdp2", "ddp-ep2"]
)
def test_two_processes_follow_one_process(tmp_path, baseline, layout):
    """Two ranks of 2 micro-batches each against one process's 4: FSDP2 (its meta build drawing each rank's shards
    from the seed), expert parallel over both under DDP (each holding 4 of the 8 experts of every block, their
    biases with them, DDP reducing the rest): loss and grad norm within 1e-5 (relative). Red with DDP leaving the
    attention's weights unreduced under expert parallel (off from step 2)."""
    run = tmp_path / "run"
    proc = train(run, *STEPS, *layout, config=GPT_OSS, nproc=2)
    if "parallel.expert.size=2" in layout:
        assert "4 sparse blocks, 4 of 8 experts each" in proc.stderr
    assert_curves(baseline, run, WITHIN)


# one launch per split: mtp's column / row is msp's without the sequence shards, fsp msp's numerics
@pytest.mark.parametrize(
    ("layout", "applied"),
    [
        (["parallel.tensor.size=2", "parallel.tensor.mode=msp", "parallel.mode=fsdp2", "parallel.expert.no_tp=True"],
         "Applied tensor parallel msp over 2 ranks"),
        (["parallel.tensor.size=2", "parallel.tensor.mode=isp", "parallel.mode=ddp"],
         "Applied tensor parallel isp over 2 ranks"),
        (["parallel.pipeline.size=2"], "Pipeline rank 0 of 2: stages [0] of 2"),
    ],
    ids=["msp", "isp", "pipeline2"],
)  # fmt: skip
def test_the_splits_follow_one_process(tmp_path, baseline, layout, applied):
    """T=2 msp under FSDP2: q/k/v column parallel with their biases, o row parallel (its bias added once after the
    reduce-scatter), each rank's 2 of the 4 sinks with its 2 query heads (1 kv head each), every sparse block whole
    routing its rank's chunk of the sequence; isp under DDP: each rank's 32 of 64 tokens, Ulysses handing it 2 heads
    for the whole sequence and its attention cutting the same 2 sinks; a pipeline of 2 stages (2 blocks each, a
    sliding and a full one). Loss and grad norm within 1e-5 (relative) of one process. Red with every rank attending
    with rank 0's sinks (msp and isp alike: step 1's loss 5.53414 against 5.53397) and with a stage dropping YaRN's
    attention factor (step 1's loss 5.53460)."""
    run = tmp_path / "run"
    proc = train(run, *STEPS, *layout, config=GPT_OSS, nproc=2)
    assert applied in proc.stderr
    assert_curves(baseline, run, WITHIN)


def test_an_mxfp4_folder_trains_from_the_folder_alone(tmp_path):
    """A transformers GptOssForCausalLM saved with its experts as MXFP4 blocks and scales: a config naming the folder
    trains (dequantised on load) and the loss goes down; FSDP2 on two processes (its meta build reading the folder a
    piece at a time, each MXFP4 pair together) follows it within 1e-5."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    config = transformers.GptOssConfig(vocab_size=259, hidden_size=64, intermediate_size=64, head_dim=16,
                                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                       num_experts_per_tok=2, num_hidden_layers=2, sliding_window=16)  # fmt: skip
    folder = tmp_path / "gpt_oss"
    transformers.GptOssForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inner, outer = tensors.pop(name).shape
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (experts, outer, inner // 32, 16), dtype=torch.uint8)
        tensors[f"{name}_scales"] = torch.full((experts, outer, inner // 32), 121, dtype=torch.uint8)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = tmp_path / "gpt_oss.py"
    cfg.write_text(
        f"_base_ = [{str(GPT_OSS)!r}]\nmodel = dict(_delete_=True, type='gpt_oss', hf_path={str(folder)!r})\n"
    )
    steps = ["data.total_steps=6", "data.global_bsz=8", "ckpt.checkpoint_every=6", "ckpt.keep_last=0"]
    train(tmp_path / "one", *steps, config=cfg)
    losses = [r["loss"] for r in metrics(tmp_path / "one")]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    proc = train(tmp_path / "fsdp2", *steps, "parallel.mode=fsdp2", config=cfg, nproc=2)
    assert "Loaded" in proc.stderr
    assert_curves(tmp_path / "one", tmp_path / "fsdp2", WITHIN)
