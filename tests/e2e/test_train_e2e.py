"""End to end through train.py: determinism, resume, parallel modes, the default config."""

import json
import math
import shutil

import pytest
from mmengine.config import Config
from runner import BASELINE_NPROC, REPO, baseline_options, losses, metrics, train

pytestmark = pytest.mark.e2e

LAYOUTS = BASELINE_NPROC  # one process, DDP and FSDP2 on two


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory, baseline):
    """Each layout trained twice, 8 steps, checkpoints at 4 and 8 (shared by the tests below): the first is the
    suite's shared baseline (conftest.py), the second this file's own."""
    runs = {}
    for mode, nproc in LAYOUTS.items():
        runs[mode, "a"] = baseline(mode)
        runs[mode, "b"] = tmp_path_factory.mktemp(f"{mode}_b")
        train(runs[mode, "b"], *baseline_options(mode), nproc=nproc)
    return runs


@pytest.mark.parametrize("mode", LAYOUTS)
def test_same_config_twice_is_bitwise(full_runs, mode):
    first, second = metrics(full_runs[mode, "a"]), metrics(full_runs[mode, "b"])
    assert [r["step"] for r in first] == list(range(1, 9))
    assert [(r["loss"], r["grad_norm"]) for r in first] == [(r["loss"], r["grad_norm"]) for r in second]


@pytest.mark.parametrize("mode", LAYOUTS)
def test_resume_is_bitwise(full_runs, tmp_path, mode):
    """Stop after step 4 (its checkpoint), resume: steps 5..8 equal the uninterrupted run's."""
    full = full_runs[mode, "a"]
    resumed = tmp_path / "resumed"
    shutil.copytree(full / "checkpoints" / "step_00000004", resumed / "checkpoints" / "step_00000004")
    train(resumed, *baseline_options(mode), nproc=LAYOUTS[mode], resume=True)
    expected = [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in metrics(full) if r["step"] > 4]
    got = [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in metrics(resumed)]
    assert got == expected


def test_layouts_agree_within_reduction_order(full_runs):
    """Same global batch on 1 process, DDP and FSDP2 (its default meta build): one initial model; every step within
    1e-5 relative. Not bitwise even at step 1 (forward only): its four micro-batch losses are summed in another
    grouping, ((l0 + l1) + l2) + l3 on one process, (l0 + l2) + (l1 + l3) over two ranks (2 ulp apart under
    MKL_CBWR=COMPATIBLE; tests/README.md)."""
    base = losses(full_runs["none", "a"])
    for mode in ("ddp", "fsdp2"):
        other = losses(full_runs[mode, "a"])
        assert other.keys() == base.keys()
        for step, loss in base.items():
            assert math.isclose(other[step], loss, rel_tol=1e-5), (mode, step, other[step], loss)


def test_checkpoint_folder_layout(full_runs):
    ckpt = full_runs["fsdp2", "a"] / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_00000008"
    for step in ("step_00000004", "step_00000008"):
        assert {"manifest.json", "train_state.pt", ".metadata", "rng"} <= {p.name for p in (ckpt / step).iterdir()}
        assert sorted(p.name for p in (ckpt / step / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]
    assert not list(ckpt.glob(".tmp-*"))


def test_default_config_trains_with_falling_loss(tmp_path):
    """`make train`'s config, shortened: the loss falls clearly and the run writes its files."""
    work_dir = tmp_path / "tiny"
    proc = train(work_dir, "data.total_steps=60", config=REPO / "configs" / "internlm2_tiny.py")
    records = metrics(work_dir)
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert {"step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "step_time_s"} <= records[0].keys()
    assert {"device_mem_bytes", "device_peak_mem_bytes", "host_rss_bytes"} <= records[0].keys()
    # the resolved config twice: as JSON, and as a Python config that loads back to the same values
    resolved = json.loads((work_dir / "config.json").read_text())
    assert json.loads(json.dumps(Config.fromfile(work_dir / "config.py").to_dict())) == resolved  # tuples as lists
    assert "Layer plan" in proc.stderr


def test_fresh_run_in_used_work_dir_is_refused_and_keeps_checkpoints(full_runs, tmp_path):
    work_dir = tmp_path / "used"
    shutil.copytree(full_runs["none", "a"], work_dir)
    before = sorted(p.name for p in (work_dir / "checkpoints").iterdir())
    proc = train(work_dir, *baseline_options(), check=False)
    assert proc.returncode == 2
    assert "already holds checkpoints" in proc.stderr and "--resume" in proc.stderr
    assert sorted(p.name for p in (work_dir / "checkpoints").iterdir()) == before


@pytest.mark.parametrize("mode", ["none", "fsdp2"])
def test_hugging_face_model_trains_with_the_same_keys(tmp_path, mode):
    """A Hugging Face llama built from a config dict, checkpointed blocks, alone and under FSDP2."""
    config = REPO / "configs" / "hf_llama_tiny.py"
    options = ["data.total_steps=4", "model.checkpoint=0.5", f"parallel.mode={mode}"]
    proc = train(tmp_path, *options, config=config, nproc=LAYOUTS[mode])
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["loss"] < records[0]["loss"]
    assert "Applied full activation checkpointing to 2 of 4 blocks" in proc.stderr


def test_meta_build_on_one_rank_draws_todays_weights(tmp_path):
    """FSDP2 on one rank: the meta build + shard init gives bitwise the curve of the whole build."""
    runs = {}
    for meta in (True, False):
        runs[meta] = tmp_path / f"meta_{meta}"
        proc = train(
            runs[meta],
            "data.total_steps=3",
            "ckpt.enable_save_ckpt=False",
            "parallel.mode=fsdp2",
            f"parallel.meta_init={meta}",
            torchrun=True,
        )
        assert ("Materialized and initialized this rank's shards" in proc.stderr) == meta
        assert "Model built:" in proc.stderr
    assert metrics(runs[True]) and [r["loss"] for r in metrics(runs[True])] == [r["loss"] for r in metrics(runs[False])]
