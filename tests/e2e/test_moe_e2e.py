"""The native mixture-of-experts model trains through train.py: configs/internlm2_tiny_moe.py, 3 steps, one process."""

from pathlib import Path

from tests.e2e.runner import REPO, metrics, train

MOE = REPO / "configs" / "internlm2_tiny_moe.py"
STEPS = ["data.total_steps=3", "ckpt.enable_save_ckpt=False"]


def test_moe_trains_and_logs_its_aux_loss_bitwise_again(tmp_path: Path) -> None:
    """Both moe_types: three finite steps with moe_aux_loss (already times loss.moe_loss_coeff=0.01: about 0.01 per
    sparse block for a near-uniform router) in metrics.jsonl; a second run of the same seed logs the same values."""
    for moe_type in ("GShard", "Dropless"):
        runs = []
        for attempt in range(2):
            work_dir = tmp_path / f"{moe_type}_{attempt}"
            train(work_dir, *STEPS, f"model.moe_type={moe_type}", config=MOE)
            runs.append(metrics(work_dir))
        first, second = runs
        assert [r["step"] for r in first] == [1, 2, 3]
        # 2 micro-batches x 2 rows x 64 tokens, 2 choices each, 4 sparse blocks: Dropless computes every choice,
        # GShard at most that (capacity ceil(128 / 4 * 1.0 * 2) = 64 per expert and block)
        routed = 2 * 2 * 64 * 2 * 4
        for record in first:
            assert 0.0 < record["moe_aux_loss"] < 0.1, record  # 4 blocks x ~1 x 0.01
            counts = record["moe_tokens_per_expert"]
            assert len(counts) == 4 and record["moe_max_load"] >= 1.0
            assert sum(counts) == routed if moe_type == "Dropless" else 0 < sum(counts) <= routed
            assert max(counts) <= 64 * 4 * 2 or moe_type == "Dropless"  # GShard: capacity x blocks x micro-batches
        keys = ("loss", "grad_norm", "moe_aux_loss")
        assert [[r[k] for k in keys] for r in first] == [[r[k] for k in keys] for r in second]
