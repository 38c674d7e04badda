"""An InternEvo config, shrunk in size only, trains here through train.py."""

import pytest
from runner import REPO, metrics, train

pytestmark = pytest.mark.e2e

SHRUNK = REPO / "tests" / "data" / "internevo_7b_sft_shrunk.py"
# The key sets of InternEvo's other shipped dense configs, shrunk in size only.
SHIPPED = [
    "internevo_7b_internlm2_shrunk.py",
    "internevo_8b_internlm3_shrunk.py",
    "internevo_7b_llama2_shrunk.py",
    "internevo_7b_isp_sft_shrunk.py",
]


def test_internevo_config_trains_three_steps_and_says_what_it_mapped(tmp_path):
    proc = train(tmp_path, "data.seq_len=64", config=SHRUNK)
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3]
    assert "InternEvo key: model.layer_norm_epsilon -> model.norm_eps" in proc.stderr
    assert "InternEvo keys without effect here, ignored:" in proc.stderr
    assert "WARNING internlm_offload.launch: data.train_folder=None" in proc.stderr


def test_label_smoothing_changes_the_loss(tmp_path):
    plain, smoothed = tmp_path / "plain", tmp_path / "smoothed"
    options = ["data.total_steps=1", "ckpt.enable_save_ckpt=False"]
    train(plain, *options)
    train(smoothed, *options, "loss.label_smoothing=0.1")
    assert metrics(smoothed)[0]["loss"] > metrics(plain)[0]["loss"]


@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_internevo_config_trains_three_steps(tmp_path, name):
    train(tmp_path, "data.seq_len=64", "data.total_steps=3", config=REPO / "tests" / "data" / name)
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["loss"] == r["loss"] for r in records)


def test_isp_config_trains_with_its_shipped_tensor_and_weight_sizes(tmp_path):
    """7B_isp_sft.py's parallel section at its own sizes (isp over 2 ranks, weight parallel over 4) and its
    cpu_offloading block, on four processes: the section maps onto FSDP2 over the weight group."""
    sizes = ["parallel.tensor.size=2", "parallel.weight.size=4"]
    config = REPO / "tests" / "data" / "internevo_7b_isp_sft_shrunk.py"
    proc = train(tmp_path, "data.seq_len=64", "data.total_steps=3", *sizes, nproc=4, config=config)
    assert "Applied tensor parallel isp over 2 ranks" in proc.stderr and "Applied FSDP2 over 4 ranks" in proc.stderr
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["loss"] == r["loss"] for r in records)
    assert records[-1]["act_offload_offloaded_bytes"] > 0
