"""The DeepSeek-V3 family over ranks (torchrun over gloo): DDP and FSDP2 on two processes, expert parallel 2 x expert
data 2 on four, and tensor parallel (mtp / msp / fsp / isp on two) follow one process of the same global batch within
tensor_parallel_runs.NEAR (loss 1e-5 relative, grad norm 1e-4: the reductions run in another order); GLM-4.5's
grouped-query attention under msp too. The router biases are bitwise one process's in every layout (`torch.equal`):
each moves by +-speed by the sign of its expert's load against the mean, and the loads are integer counts pooled over
every rank, so a layout that routes the tokens as one process does counts the same and moves every bias the same.
That holds while no choice sits at a tie within the layouts' rounding: one flipped choice moves `moe_maxvio` (checked
within 1 %), and a bias only where its expert's count was within one of the mean. Measured on AVX-512 and with
TEST_SHIFTED_KERNELS=all: the biases equal in every layout here. FSDP2 on a folder starts from its weights.
The tiny config runs multi-token prediction (one depth), so every layout here carries it too: its block planned after
the main ones (tensor parallel's styles, isp's exchange, expert parallel's 4th sparse block, FSDP2's unit), its norms
sequence parallel and its eh_proj column parallel gathered back under msp / fsp, its ids and labels rolled on the
whole sequence before isp's split, its router's bias bitwise one process's (`assert_same_biases`).
"""

import pytest
import torch
from deepseek_runs import DEEPSEEK, STEPS, assert_same_biases, family_baseline
from runner import metrics, train
from tensor_parallel_runs import NEAR, assert_curves, tensor

pytestmark = pytest.mark.e2e

COLUMN_ROW = ["parallel.mode=fsdp2", "parallel.expert.no_tp=True"]  # each sparse block whole, routing its own chunk
# GLM-4.5: grouped-query attention (2 kv heads for 4) with partial RoPE, q/k norms and biases, a dense first block
GLM45 = dict(model_type="glm4_moe", vocab_size=259, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
             num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
             use_qk_norm=True, attention_bias=True,
             rope_parameters=dict(rope_theta=10000.0, partial_rotary_factor=0.5, rope_type="default"))  # fmt: skip


@pytest.fixture(scope="module")
def one_process(reference_run):
    """The family's fp32 baseline on one process (test_deepseek_tiers_e2e.py's too)."""
    return family_baseline(reference_run)


def assert_follows(one, run) -> None:
    """`run` within NEAR of `one` at every step, `mtp_loss` within the loss's 1e-5, `moe_maxvio` within 1 % (a choice
    at a near tie may flip: measured once, GLM-4.5 under msp at step 3, 2.9583 against 2.9609) and the last biases bit
    for bit."""
    assert_curves(one, run, NEAR)
    got, want = ([r["moe_maxvio"] for r in metrics(path)] for path in (run, one))
    assert got == pytest.approx(want, rel=1e-2), (got, want)
    got, want = ([r["mtp_loss"] for r in metrics(path)] for path in (run, one))
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    assert_same_biases(one, run)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_data_parallel_on_two_processes_follows_one_process(tmp_path, reference_run, one_process, mode):
    """Two ranks of 2 micro-batches each against one process's 4: DDP, and FSDP2 (its meta build drawing each
    rank's shards from the seed, the bias zeroed; FSDP2's run is test_deepseek_tiers_e2e.py's baseline too)."""
    run = family_baseline(reference_run, mode=mode) if mode == "fsdp2" else tmp_path / mode
    if mode == "ddp":
        train(run, *STEPS, "parallel.mode=ddp", config=DEEPSEEK, nproc=2)
    assert_follows(one_process, run)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_ep_2_by_expert_data_2_follows_one_process(tmp_path, one_process, mode):
    """Four ranks, expert groups {0, 1} and {2, 3}, each holding 4 of the 8 experts of every sparse block (the dense
    first block has none): each rank counts its own tokens' choices, and the counts pooled over all four give one
    process's. Red with the counts pooled over the expert group alone (half the tokens: step 2's loss off)."""
    run = tmp_path / f"ep2_edp2_{mode}"
    proc = train(run, *STEPS, f"parallel.mode={mode}", "parallel.expert.size=2", config=DEEPSEEK, nproc=4)
    assert "Applied expert parallel over 2 ranks (2 expert-data groups): 4 sparse blocks, 4 of 8 experts" in proc.stderr
    assert_follows(one_process, run)


@pytest.mark.parametrize("mode", ["mtp", "msp", "fsp", "isp"])
def test_tensor_parallel_follows_one_process(tmp_path, one_process, mode):
    """T=2. mtp / msp / fsp under FSDP2: MLA's q_b_proj and kv_b_proj split by whole heads, o_proj by rows, q_a_proj,
    kv_a_proj_with_mqa and their latent norms whole on every rank (the shared rope key's gradient summed over both);
    the dense block's SwiGLU column / row; each sparse block whole, routing its rank's chunk of the sequence. isp under
    DDP: each rank's chunk of the sequence, whole heads of the expanded q, k, v exchanged around attending. Red
    without the rope key's sum (each rank's kv_a_proj_with_mqa then learns from its own heads' part: step 2's loss
    off, 8.2e-4 by step 6 under mtp)."""
    run = tmp_path / mode
    options = tensor(mode) + (COLUMN_ROW if mode != "isp" else [])
    proc = train(run, *STEPS, *options, config=DEEPSEEK, nproc=2)
    assert f"Applied tensor parallel {mode} over 2 ranks" in proc.stderr
    assert_follows(one_process, run)


def test_glm45_grouped_query_attention_under_msp_follows_one_process(tmp_path):
    """GLM-4.5's attention takes the native decoder's plan (wq, wk, wv column, wo row; its q/k norms per head whole
    on every rank, their gradients summed over the tensor group): msp at T=2 follows one process, the grad norm
    within 1e-5 too (its norms are the weights every rank's heads update). Red with wk and wv planned over 1 kv head
    (each rank keeping kv head 0: step 1's loss 0.061 off), and with the q/k norms' gradients left to each rank's own
    heads (the ranks' norms drift apart: the grad norm past 1e-5 within the 6 steps)."""
    config = tmp_path / "glm45.py"
    config.write_text(f"_base_ = [{str(DEEPSEEK)!r}]\nmodel = dict(hf_config=dict(_delete_=True, **{GLM45!r}))\n")
    one, msp = tmp_path / "one", tmp_path / "msp"
    train(one, *STEPS, config=config)
    train(msp, *STEPS, "parallel.tensor.size=2", "parallel.tensor.mode=msp", *COLUMN_ROW, config=config, nproc=2)
    assert_follows(one, msp)
    got, want = ([r["grad_norm"] for r in metrics(path)] for path in (msp, one))
    assert got == pytest.approx(want, rel=1e-5), (got, want)


def test_fsdp2_reads_a_folder_into_its_shards_and_starts_from_its_weights(tmp_path):
    """model.hf_path under FSDP2 (one process, a group of one): the model is built on meta, sharded, and the folder read
    into the shards (tests/unit/test_folder_shards.py: bit for bit the whole build's over 2 ranks): step 1 is the plain
    run's. Red without the read (the seed's weights: step 1's loss 5.518 against 5.591)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "folder"
    config = {key: value for key, value in GLM45.items() if key != "model_type"}
    torch.manual_seed(0)
    transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**config)).save_pretrained(folder)
    cfg = tmp_path / "folder.py"
    cfg.write_text(
        f"_base_ = [{str(DEEPSEEK)!r}]\nmodel = dict(_delete_=True, type='deepseek_v3', hf_path={str(folder)!r})\n"
    )
    plain, sharded = tmp_path / "plain", tmp_path / "fsdp2"
    one_step = ["data.total_steps=1", "ckpt.enable_save_ckpt=False"]
    train(plain, *one_step, config=cfg)
    proc = train(sharded, *one_step, "parallel.mode=fsdp2", config=cfg)
    (want,), (got,) = metrics(plain), metrics(sharded)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), (got["loss"], want["loss"])
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (got["grad_norm"], want["grad_norm"])
    assert "Loaded" in proc.stderr and "Materialized and initialized this rank's shards" in proc.stderr
