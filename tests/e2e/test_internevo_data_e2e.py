"""InternEvo-tokenized folders through train.py: packing with documents apart, validation, resume, skip_batches."""

import shutil
import sys

import pytest
from runner import metrics, run_python, train

pytestmark = pytest.mark.e2e

DATA = ["data.seq_len=32", "data.micro_bsz=2", "data.micro_num=2", "data.valid_every=2", "data.valid_micro_num=2"]


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """Text files tokenized by the shipped tool into train/ and valid/{en,py}/ folders of .bin/.bin.meta."""
    root = tmp_path_factory.mktemp("tokenized")
    from pydoc_data.topics import topics

    texts = [topics[k] for k in sorted(topics)]
    sources = {"train": texts[:40], "valid/en": texts[40:52], "valid/py": texts[52:60]}
    for name, docs in sources.items():
        src = root / "src" / name
        src.mkdir(parents=True)
        for i, text in enumerate(docs):
            (src / f"doc{i:03d}.txt").write_text(text[:600])
        tokenize = [sys.executable, "-m", "internlm_offload.tools.tokenize", str(src), str(root / name)]
        assert run_python(tokenize).returncode == 0
    return root


def _options(data, *extra):
    return [f"data.train_folder={data / 'train'}", f"data.valid_folder={data / 'valid'}", *DATA, *extra]


@pytest.fixture(scope="module")
def one_process_run(tokenized, tmp_path_factory):
    """Four steps on one process with packed documents and validation, checkpoints at 2 and 4: the resume test's
    full run and the tensor-parallel reference (trained once for both)."""
    run = tmp_path_factory.mktemp("one_process")
    train(run, *_options(tokenized, "data.total_steps=4", "ckpt.checkpoint_every=2"))
    return run


def test_tokenized_folder_trains_validates_and_resumes_bitwise(tokenized, one_process_run, tmp_path):
    full, resumed = one_process_run, tmp_path / "resumed"
    options = _options(tokenized, "data.total_steps=4", "ckpt.checkpoint_every=2")
    records = metrics(full)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert ["valid_loss" in r for r in records] == [False, True, False, True]
    assert {"valid_loss/en", "valid_loss/py", "valid_ppl"} <= set(records[1])
    assert records[3]["valid_loss"] < records[1]["valid_loss"]  # it learns, and validation sees it
    shutil.copytree(full / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    train(resumed, *options, resume=True)
    for metric in ("loss", "valid_loss"):
        cmd = [
            sys.executable,
            "-m",
            "internlm_offload.tools.loss_compare",
            str(full),
            str(resumed),
            "--exact",
            "--metric",
            metric,
            "--steps",
            "3:",
        ]
        proc = run_python(cmd)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_two_ranks_validate_the_same_documents_as_one(tokenized, tmp_path):
    # valid_micro_num=1: batches of 2 documents, which the 12 + 8 documents fill on 1 and on 2 ranks alike
    options = _options(
        tokenized, "data.total_steps=2", "data.global_bsz=4", "ckpt.enable_save_ckpt=False", "data.valid_micro_num=1"
    )
    train(tmp_path / "one", *options)
    train(tmp_path / "two", *options, "parallel.mode=ddp", nproc=2)
    one, two = metrics(tmp_path / "one")[1], metrics(tmp_path / "two")[1]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert two["valid_loss"] == pytest.approx(one["valid_loss"], rel=1e-5)


def test_skip_batches_discards_the_named_batches(tokenized, tmp_path):
    options = _options(tokenized, "data.total_steps=3", "data.valid_every=0", "ckpt.enable_save_ckpt=False")
    train(tmp_path / "plain", *options)
    proc = train(tmp_path / "skip", *options, "data.skip_batches=1")
    plain, skip = metrics(tmp_path / "plain"), metrics(tmp_path / "skip")
    assert [r["step"] for r in skip] == [1, 2, 3]
    assert skip[0]["loss"] == plain[0]["loss"] and skip[1]["loss"] != plain[1]["loss"]
    assert "data.skip_batches: batch 1 discarded" in proc.stderr


@pytest.mark.parametrize("mode", ["msp", "isp"])
def test_packed_documents_and_validation_under_tensor_parallel(tokenized, one_process_run, tmp_path, mode):
    """T=2: packed documents (positions restart per document, attention kept inside each; isp splits the
    tokens, positions and labels of each sequence alike) and the validation sets give the one-process losses
    within 1e-5 (the tensor ranks read the same micro-batches)."""
    one, tensor = one_process_run, tmp_path / "tensor"
    options = _options(tokenized, "data.total_steps=4", "ckpt.enable_save_ckpt=False")
    layout = ["parallel.tensor.size=2", f"parallel.tensor.mode={mode}"] + (
        ["parallel.mode=ddp"] if mode == "isp" else []
    )
    train(tensor, *options, *layout, nproc=2)
    got, want = metrics(tensor), metrics(one)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for metric in ("loss", "valid_loss", "valid_loss/en"):
        pairs = [(r[metric], w[metric]) for r, w in zip(got, want) if metric in w]
        assert pairs and all(g == pytest.approx(w, rel=1e-5) for g, w in pairs), (metric, pairs)
