"""Unit tests for internlm_offload.data: tokenizers, corpus, packing, the step sampler and loader."""

import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from internlm_offload.data import (
    ByteTokenizer,
    DataError,
    HFTokenizer,
    PackedDataset,
    StepLoader,
    StepSampler,
    build_tokenizer,
    builtin_documents,
    read_documents,
)
from internlm_offload.registry import DATASETS, lookup

# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip_non_ascii() -> None:
    tok = ByteTokenizer()
    text = "héllo wörld — 你好 🙂"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_byte_tokenizer_specials() -> None:
    tok = ByteTokenizer()
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 259)
    assert tok.decode([tok.bos_id, *tok.encode("ab"), tok.eos_id, tok.pad_id]) == "ab"
    assert tok.decode([0xC3]) == "\ufffd"  # a truncated UTF-8 sequence is replaced, not raised


def test_build_tokenizer_byte_and_missing_dir(tmp_path: Path) -> None:
    assert isinstance(build_tokenizer(), ByteTokenizer)
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)
    missing = tmp_path / "no_such_tokenizer"
    with pytest.raises(DataError, match=re.escape(str(missing))):
        build_tokenizer(str(missing))


def test_hf_tokenizer_without_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    with pytest.raises(ImportError, match=re.escape('pip install "internlm_offload[hf]"')):
        HFTokenizer(str(tmp_path))


def test_hf_tokenizer_dir_without_tokenizer_files(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    with pytest.raises(DataError, match=re.escape(f"cannot load a tokenizer from {tmp_path}")):
        HFTokenizer(str(tmp_path))


def _save_tiny_hf_tokenizer(path: Path) -> None:
    """Train a WordLevel tokenizer on a few strings and save it as a transformers tokenizer, offline."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"])
    tok.train_from_iterator(["the cat sat on the mat", "the dog ate the cat"], trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")
    fast.save_pretrained(str(path))


def test_hf_tokenizer_from_a_hub_id_in_the_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """XTuner's configs name tokenizers by hub id: one already downloaded is read from the cache, offline; one not
    there is refused in one line naming the id and the cache."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / ("0" * 40)
    _save_tiny_hf_tokenizer(snapshot)
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    tok = build_tokenizer("org/tiny")
    assert tok.encode("hello world") == HFTokenizer(str(snapshot)).encode("hello world")
    with pytest.raises(DataError) as info:
        build_tokenizer("org/absent")
    assert str(info.value).startswith("data.tokenizer='org/absent': not a local directory and not in the Hugging")
    assert str(cache) in str(info.value) and "\n" not in str(info.value)


def test_hf_tokenizer_local(tmp_path: Path) -> None:
    _save_tiny_hf_tokenizer(tmp_path)
    tok = build_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 2 + len({"the", "cat", "sat", "on", "mat", "dog", "ate"})
    assert tok.eos_id == tok._tok.convert_tokens_to_ids("</s>")
    ids = tok.encode("the cat sat")
    assert len(ids) == 3 and tok.eos_id not in ids
    assert tok.decode([*ids, tok.eos_id]) == "the cat sat"
    ds = PackedDataset(["the cat sat on the mat"] * 4, tok, seq_len=5)
    assert len(ds) == (4 * 7 - 1) // 5


# ---------------------------------------------------------------- corpus


def test_builtin_documents_deterministic_and_large() -> None:
    docs = builtin_documents()
    assert docs and all(isinstance(d, str) for d in docs)
    assert sum(len(d.encode("utf-8")) for d in docs) > 300_000
    assert builtin_documents() == docs


def test_read_documents_txt_jsonl_and_directory(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second file", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first file", encoding="utf-8")
    (tmp_path / "c.jsonl").write_text('{"text": "line one"}\n\n{"text": "line two", "id": 2}\n', encoding="utf-8")
    (tmp_path / "ignored.md").write_text("not read", encoding="utf-8")
    assert read_documents([str(tmp_path / "a.txt")]) == ["first file"]
    assert read_documents([str(tmp_path / "c.jsonl")]) == ["line one", "line two"]
    assert read_documents([str(tmp_path)]) == ["first file", "second file", "line one", "line two"]


def test_read_documents_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "x" / "y.txt"
    with pytest.raises(DataError, match=re.escape(f"data.paths: file not found: {missing}")):
        read_documents([str(missing)])


def test_read_documents_unsupported_suffix(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("a,b", encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_documents([str(path)])
    assert str(path) in str(err.value) and ".txt" in str(err.value) and ".jsonl" in str(err.value)


def test_read_documents_bad_json_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{not json\n', encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(f"{path} line 2: not valid JSON")):
        read_documents([str(path)])


@pytest.mark.parametrize("line", ['{"body": "x"}', '{"text": 3}', '["text"]'])
def test_read_documents_jsonl_without_text(tmp_path: Path, line: str) -> None:
    path = tmp_path / "notext.jsonl"
    path.write_text(f'{{"text": "ok"}}\n\n{line}\n', encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(f"{path} line 3: ") + '.*"text"'):
        read_documents([str(path)])


def test_read_documents_no_documents(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataError, match="no documents"):
        read_documents([str(empty)])
    (tmp_path / "sub").mkdir()
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "sub"))):
        read_documents([str(tmp_path / "sub")])


def test_errors_are_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("{\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_documents([str(path)])
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)


# ---------------------------------------------------------------- packing


def test_packed_dataset_shapes_shift_and_eos() -> None:
    tok = ByteTokenizer()
    docs = ["abcdefg", "hij", "klmnopqrstu"]
    ds = PackedDataset(docs, tok, seq_len=4)
    stream = [t for d in docs for t in (*tok.encode(d), tok.eos_id)]
    assert ds.tokens.tolist() == stream
    assert ds.tokens.dtype in (torch.int32, torch.int64)
    assert len(ds) == (len(stream) - 1) // 4
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (4,)
        assert x.tolist() == stream[i * 4 : i * 4 + 4]
        assert y.tolist() == stream[i * 4 + 1 : i * 4 + 5]
        assert x[1:].tolist() == y[:-1].tolist()
    # Across a sample boundary: the last label of sample i is the first input of sample i + 1.
    assert ds[0][1][-1] == ds[1][0][0]
    # eos separates documents: "abcdefg" is 7 bytes, so token 7 (sample 1, position 3) is eos.
    assert ds[1][0][3] == tok.eos_id and ds[1][1][2] == tok.eos_id


def test_packed_dataset_too_short() -> None:
    with pytest.raises(DataError, match=r"seq_len=16.* 4 tokens"):
        PackedDataset(["abc"], ByteTokenizer(), seq_len=16)
    with pytest.raises(DataError, match="seq_len"):
        PackedDataset(["abc"], ByteTokenizer(), seq_len=0)


def test_registry_builtin_and_text(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    builtin = lookup(DATASETS, "builtin", "data.type")(seq_len=256, tokenizer=tok)
    assert isinstance(builtin, PackedDataset) and len(builtin) > 1000
    (tmp_path / "a.txt").write_text("x" * 100, encoding="utf-8")
    text = lookup(DATASETS, "text", "data.type")(seq_len=8, tokenizer=tok, paths=[str(tmp_path)])
    assert isinstance(text, PackedDataset) and len(text) == 100 // 8


# ---------------------------------------------------------------- sampler


def _sampler(num_samples: int = 37, **kw: int) -> StepSampler:
    args = dict(micro_bsz=2, micro_num=3, rank=0, world_size=1, seed=5)
    args.update(kw)
    return StepSampler(num_samples, **args)


def _global_step(num_samples: int, steps: int, micro_bsz: int, micro_num: int, world_size: int) -> list[list[int]]:
    """The multiset (sorted) of indices consumed by all ranks, per step."""
    samplers = [
        _sampler(num_samples, micro_bsz=micro_bsz, micro_num=micro_num, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    out = []
    for _ in range(steps):
        out.append(sorted(i for s in samplers for mb in s.next_step() for i in mb))
    return out


def test_sampler_deterministic_and_shapes() -> None:
    a, b = _sampler(), _sampler()
    for _ in range(10):
        step = a.next_step()
        assert step == b.next_step()
        assert len(step) == 3 and all(len(mb) == 2 for mb in step)
    assert _sampler(seed=6).next_step() != _sampler().next_step()


def test_sampler_epoch_covers_every_index_once() -> None:
    n = 48
    s = _sampler(n, micro_bsz=4, micro_num=3)  # G = 12 divides n: 4 steps are exactly one epoch
    seen = [i for _ in range(4) for mb in s.next_step() for i in mb]
    assert sorted(seen) == list(range(n))
    assert seen != list(range(n))  # shuffled
    nxt = [i for _ in range(4) for mb in s.next_step() for i in mb]
    assert sorted(nxt) == list(range(n)) and nxt != seen  # a new permutation for epoch 1


def test_sampler_no_shuffle_is_arange() -> None:
    s = _sampler(10, micro_bsz=2, micro_num=2, shuffle=False)
    assert s.next_step() == [[0, 1], [2, 3]]
    assert s.next_step() == [[4, 5], [6, 7]]
    assert s.next_step() == [[8, 9], [0, 1]]  # the epoch boundary falls inside the step


def test_sampler_world_size_invariance() -> None:
    ws1 = _global_step(41, 12, micro_bsz=2, micro_num=4, world_size=1)
    ws2 = _global_step(41, 12, micro_bsz=2, micro_num=2, world_size=2)
    ws4 = _global_step(41, 12, micro_bsz=2, micro_num=1, world_size=4)
    assert ws1 == ws2 == ws4


def test_sampler_partition_layout() -> None:
    # Micro-batch m of rank r holds entries [(m * ws + r) * mb, + mb) of the step's global batch, which is
    # what a single rank with ws times the micro-batches sees in order.
    n, mb, micro_num, ws = 29, 3, 2, 2
    for step in range(4):
        single = _sampler(n, micro_bsz=mb, micro_num=micro_num * ws)
        for _ in range(step):
            single.next_step()
        flat = [i for m in single.next_step() for i in m]
        for r in range(ws):
            ranked = _sampler(n, micro_bsz=mb, micro_num=micro_num, rank=r, world_size=ws)
            for _ in range(step):
                ranked.next_step()
            for m, got in enumerate(ranked.next_step()):
                start = (m * ws + r) * mb
                assert got == flat[start : start + mb]


def test_sampler_ranks_disjoint_within_step() -> None:
    n, ws = 1000, 4
    samplers = [_sampler(n, micro_bsz=3, micro_num=2, rank=r, world_size=ws) for r in range(ws)]
    for _ in range(5):
        per_rank = [[i for mb in s.next_step() for i in mb] for s in samplers]
        flat = [i for r in per_rank for i in r]
        assert len(flat) == len(set(flat)) == 3 * 2 * ws


@pytest.mark.parametrize("k", [0, 1, 3, 7])
def test_sampler_resume(k: int) -> None:
    # n=17, G=6: epoch boundaries fall inside steps 3, 6, ... so k=3 and k=7 resume across one.
    n = 17
    for rank in range(2):
        ref = _sampler(n, micro_bsz=1, micro_num=3, rank=rank, world_size=2)
        steps = [ref.next_step() for _ in range(k + 4)]
        first = _sampler(n, micro_bsz=1, micro_num=3, rank=rank, world_size=2)
        for _ in range(k):
            first.next_step()
        sd = first.state_dict()
        assert sd == {"consumed_samples": 6 * k, "seed": 5}
        assert all(type(v) is int for v in sd.values())
        fresh = _sampler(n, micro_bsz=1, micro_num=3, rank=rank, world_size=2)
        fresh.load_state_dict(sd)
        assert [fresh.next_step() for _ in range(4)] == steps[k:]


def test_sampler_state_same_on_every_rank() -> None:
    samplers = [_sampler(rank=r, world_size=3) for r in range(3)]
    for s in samplers:
        s.next_step()
    assert len({tuple(s.state_dict().items()) for s in samplers}) == 1


def test_sampler_global_batch_larger_than_dataset() -> None:
    n = 5
    s = _sampler(n, micro_bsz=4, micro_num=3)  # G = 12 > 5: one step spans three epochs
    for _ in range(3):
        flat = [i for mb in s.next_step() for i in mb]
        assert len(flat) == 12 and all(0 <= i < n for i in flat)
    assert s.state_dict()["consumed_samples"] == 36
    # Entries 0..9 of the stream are two whole epochs, so each index appears exactly twice in the first step.
    counts = Counter(i for mb in _sampler(n, micro_bsz=5, micro_num=2).next_step() for i in mb)
    assert counts == {i: 2 for i in range(n)}


def test_sampler_load_state_validation() -> None:
    s = _sampler()
    with pytest.raises(ValueError, match="seed"):
        s.load_state_dict({"consumed_samples": 6, "seed": 99})
    with pytest.raises(ValueError, match="missing"):
        s.load_state_dict({"seed": 5})
    with pytest.raises(ValueError, match="consumed_samples"):
        s.load_state_dict({"consumed_samples": -1, "seed": 5})


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_samples": 0}, "num_samples"),
        ({"micro_bsz": 0}, "micro_bsz"),
        ({"micro_num": -1}, "micro_num"),
        ({"world_size": 0}, "world_size"),
        ({"rank": -1}, "rank"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"micro_bsz": 1.5}, "micro_bsz"),
        ({"seed": -3}, "seed"),
    ],
)
def test_sampler_bad_args(kwargs: dict, name: str) -> None:
    args = dict(num_samples=10, micro_bsz=2, micro_num=2, rank=0, world_size=1, seed=0)
    args.update(kwargs)
    num_samples = args.pop("num_samples")
    with pytest.raises(ValueError, match=name):
        StepSampler(num_samples, **args)


# ---------------------------------------------------------------- loader


def _loader(ds: PackedDataset, **kw: int) -> StepLoader:
    return StepLoader(ds, _sampler(len(ds), **kw))


def test_step_loader_shapes_and_content() -> None:
    ds = PackedDataset(builtin_documents()[:5], ByteTokenizer(), seq_len=16)
    loader = _loader(ds, micro_bsz=3, micro_num=2, world_size=2, rank=1)
    assert loader.tokens_per_step_global == 3 * 2 * 2 * 16
    indices = _sampler(len(ds), micro_bsz=3, micro_num=2, world_size=2, rank=1).next_step()
    step = loader.next_step()
    assert len(step) == 2
    for (x, y), idx in zip(step, indices):
        assert x.shape == y.shape == (3, 16) and x.dtype == y.dtype == torch.long
        assert x.device.type == "cpu"
        assert torch.equal(x, torch.stack([ds[i][0] for i in idx]))
        assert torch.equal(x[:, 1:], y[:, :-1])


def test_step_loader_resume() -> None:
    ds = PackedDataset(["some text to pack " * 20], ByteTokenizer(), seq_len=8)
    ref = _loader(ds)
    ref_steps = [ref.next_step() for _ in range(6)]
    first = _loader(ds)
    for _ in range(3):
        first.next_step()
    resumed = _loader(ds)
    resumed.load_state_dict(first.state_dict())
    for expected in ref_steps[3:]:
        got = resumed.next_step()
        assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(got, expected))


def test_step_loader_rejects_mismatched_sampler() -> None:
    ds = PackedDataset(["x" * 100], ByteTokenizer(), seq_len=8)
    with pytest.raises(ValueError, match="dataset"):
        StepLoader(ds, _sampler(len(ds) + 1))


def test_read_documents_jsonl_non_ascii(tmp_path: Path) -> None:
    # Non-ASCII text survives a .jsonl round trip through json.dumps (ensure_ascii escapes).
    path = tmp_path / "u.jsonl"
    path.write_text(json.dumps({"text": "naïve 🙂"}) + "\n", encoding="utf-8")
    assert read_documents([str(path)]) == ["naïve 🙂"]


def test_read_documents_reads_xtuners_pretrain_content_lines(tmp_path: Path) -> None:
    path = tmp_path / "pretrain.jsonl"
    path.write_text('{"content": "hello"}\n{"text": "world"}\n', encoding="utf-8")
    assert read_documents([str(path)]) == ["hello", "world"]
