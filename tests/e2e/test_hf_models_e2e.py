"""More Hugging Face architectures: Gemma2 (no sdpa), Mixtral (router aux loss), with offload, in bf16."""

import pytest
from runner import REPO, metrics, train
from test_offload_e2e import loss_compare

pytestmark = pytest.mark.e2e

OPTIONS = ["data.total_steps=4", "ckpt.enable_save_ckpt=False", "model.dtype=torch.bfloat16"]
OFFLOAD = ["cpu_offloading.enable=True", "cpu_offloading.num_layers=2", "model.checkpoint=0.75", "swap_optimizer=True"]


@pytest.mark.parametrize("name", ["hf_gemma2_tiny", "hf_mixtral_tiny"])
def test_architecture_trains_with_offload_bitwise(tmp_path, reference_run, name):
    config = REPO / "configs" / f"{name}.py"
    base, run = tmp_path / "base", tmp_path / "offload"
    if name == "hf_mixtral_tiny":  # Mixtral's plain run is also the aux-loss test's: trained once per pytest run
        base = reference_run(*OPTIONS, config=config)
    else:
        proc = train(base, *OPTIONS, config=config)
    train(run, *OPTIONS, *OFFLOAD, config=config)
    for metric in ("loss", "grad_norm"):
        assert loss_compare(str(base), str(run), "--exact", "--quiet", "--metric", metric).returncode == 0
    records = metrics(run)
    assert records[-1]["loss"] < records[0]["loss"] and records[-1]["act_offload_offloaded_bytes"] > 0
    if name == "hf_gemma2_tiny":
        assert "gemma2 does not support sdpa attention; using eager" in proc.stderr
    else:
        assert all(0 < r["moe_aux_loss"] < 1 for r in records)


def test_explicit_sdpa_on_gemma2_is_a_clear_error(tmp_path):
    proc = train(tmp_path, *OPTIONS, "model.attn_impl=sdpa", config=REPO / "configs" / "hf_gemma2_tiny.py", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error: model.attn_impl='sdpa': gemma2 refuses it" in proc.stderr


def test_router_aux_loss_reaches_the_gradients(tmp_path, reference_run):
    """Same data and weights: the weighted aux loss changes the first step's gradient, not its LM loss."""
    config = REPO / "configs" / "hf_mixtral_tiny.py"
    with_aux, without = reference_run(*OPTIONS, config=config), tmp_path / "no_aux"
    train(without, *OPTIONS, "model.hf_config.router_aux_loss_coef=0.0", config=config)
    first, other = metrics(with_aux)[0], metrics(without)[0]
    assert first["loss"] == other["loss"] and "moe_aux_loss" not in other
    assert first["grad_norm"] != other["grad_norm"]
