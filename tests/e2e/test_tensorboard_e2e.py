"""monitor.tensorboard: metrics.jsonl's numbers as TensorBoard scalars under the same names; a resumed run
replaces what an earlier attempt wrote past its checkpoint, as it does in metrics.jsonl."""

import shutil

import numpy as np
import pytest
from runner import metrics, train

pytestmark = pytest.mark.e2e


def scalars(work_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar event in the run's TensorBoard folder, by tag, in the order TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(work_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_holds_every_step_of_metrics_jsonl_after_a_resume(tmp_path):
    run = tmp_path / "run"
    train(run, "data.total_steps=4", "ckpt.checkpoint_every=2", "monitor.tensorboard=True")
    shutil.rmtree(run / "checkpoints" / "step_00000004")  # as if the run died after writing steps 3 and 4
    (run / "checkpoints" / "latest").unlink(missing_ok=True)
    first_attempt = metrics(run)
    # another clip: step 4 comes out different, so a stale value would show
    train(run, "data.total_steps=4", "ckpt.checkpoint_every=2", "monitor.tensorboard=True",
          "hybrid_zero_optimizer.clip_grad_norm=0.01", resume=True)  # fmt: skip
    records, board = metrics(run), scalars(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[3]["loss"] != first_attempt[3]["loss"]
    for name in ("loss", "grad_norm", "lr", "tokens"):
        # each step once, with the value metrics.jsonl holds (TensorBoard keeps float32)
        assert board[name] == [(r["step"], np.float32(r[name])) for r in records], name
