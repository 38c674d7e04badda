"""InternEvo's tokenized data: reading .bin/.bin.meta, packing as InternEvo packs, documents kept apart."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from internlm_offload.data import DataError, build_internevo_dataset
from internlm_offload.data.tokenized import IGNORE_INDEX, SHUFFLE_SEED, find_bin_files, open_bin_file, write_bin_file
from internlm_offload.data.validation import find_validation_sets
from internlm_offload.model.families.internlm2.model import InternLM2


def _documents(seed: int, count: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    docs = [rng.randint(1, 90, size=rng.randint(lo, hi)).tolist() for _ in range(count)]
    for doc in docs[::4]:
        doc[0] = -doc[0]  # InternEvo: a non-positive id is a token without loss (e.g. a prompt)
    return docs


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "b").mkdir()
    write_bin_file(tmp_path / "a.bin", _documents(0, 30))
    write_bin_file(tmp_path / "b" / "c.bin", _documents(1, 25))
    return tmp_path


# ---------------------------------------------------------------- reading


def test_bin_files_round_trip_and_are_found_recursively_in_sorted_order(folder: Path) -> None:
    assert find_bin_files(str(folder), "data.train_folder") == [folder / "a.bin", folder / "b" / "c.bin"]
    file = open_bin_file(folder / "a.bin", min_length=0)
    assert [file.document(i).tolist() for i in range(len(file))] == _documents(0, 30)


def test_min_length_drops_short_documents(folder: Path) -> None:
    file = open_bin_file(folder / "a.bin", min_length=20)
    kept = [d for d in _documents(0, 30) if len(d) >= 20]
    assert [file.document(i).tolist() for i in range(len(file))] == kept


def test_a_meta_with_extra_columns_reads_offset_first_and_length_last(tmp_path: Path) -> None:
    write_bin_file(tmp_path / "x.bin", [[1, 2, 3], [4, 5]])
    meta = np.load(tmp_path / "x.bin.meta")
    with (tmp_path / "x.bin.meta").open("wb") as f:
        np.save(f, np.stack([meta[:, 0], np.zeros(2, dtype=np.int64), meta[:, 1]], axis=1))
    file = open_bin_file(tmp_path / "x.bin", min_length=0)
    assert file.document(1).tolist() == [4, 5]


@pytest.mark.parametrize(
    "damage, message",
    [
        ("no_meta", "index x.bin.meta is missing"),
        ("wrong_meta", "the .meta belongs to another file"),
        ("bad_line", 'not a JSON object with a "tokens" list'),
    ],
)
def test_broken_files_name_the_file_and_the_problem(tmp_path: Path, damage: str, message: str) -> None:
    write_bin_file(tmp_path / "x.bin", [[1, 2, 3], [4, 5]])
    if damage == "no_meta":
        (tmp_path / "x.bin.meta").unlink()
    elif damage == "wrong_meta":
        write_bin_file(tmp_path / "y.bin", [[1, 2], [4, 5, 6]])
        (tmp_path / "y.bin.meta").replace(tmp_path / "x.bin.meta")
    else:
        (tmp_path / "x.bin").write_text('{"tokens": [1, 2, 3]}\n{"text": "oops"}\n')
    with pytest.raises(DataError, match=message):
        file = open_bin_file(tmp_path / "x.bin", min_length=0)
        [file.document(i) for i in range(len(file))]


def test_an_empty_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data.train_folder: no .bin files under"):
        build_internevo_dataset(
            train_folder=str(tmp_path), seq_len=8, micro_bsz=2, pack_sample_into_one=False, min_length=0
        )


def test_token_ids_beyond_the_vocabulary_are_a_clear_error(folder: Path) -> None:
    ds = build_internevo_dataset(
        train_folder=str(folder), seq_len=8, micro_bsz=2, pack_sample_into_one=False, min_length=0
    )
    ds.vocab_size = 50
    with pytest.raises(DataError, match="model.vocab_size=50"):
        [ds[i] for i in range(len(ds))]


# ---------------------------------------------------------------- packing, against a plain re-statement


def _stream(docs: list[list[int]]) -> list[tuple[int, int, int]]:
    """(document, index in document, token) of InternEvo's shuffled document stream of one file."""
    order = np.arange(len(docs))
    np.random.RandomState(SHUFFLE_SEED).shuffle(order)
    return [(int(d), i, t) for d in order for i, t in enumerate(docs[d])]


def _expected_pack(docs, pack: int, seq_len: int, micro_bsz: int, apart: bool):
    """Tokens, labels and positions of pack `pack`, token by token from the stream."""
    stream, size = _stream(docs), seq_len * micro_bsz
    window = stream[pack * size : (pack + 1) * size]
    tokens, labels, positions = [], [], []
    for j, (d, i, t) in enumerate(window):
        chunk_start = j == 0 or window[j - 1][0] != d
        positions.append(0 if chunk_start else positions[-1] + 1)
        last_of_doc = i == len(docs[d]) - 1
        # Kept apart, a document going on into the next pack still predicts its next token; cut into one
        # stream, the last token of a pack predicts nothing.
        label = IGNORE_INDEX if last_of_doc or (not apart and j == len(window) - 1) else docs[d][i + 1]
        tokens.append(abs(t))
        labels.append(label if label > 0 else IGNORE_INDEX)
    positions = [p % seq_len for p in positions]
    return tokens, labels, positions


@pytest.mark.parametrize("apart", [True, False])
def test_packs_hold_internevos_tokens_labels_and_positions(tmp_path: Path, apart: bool) -> None:
    docs = _documents(3, 40, lo=2, hi=30)
    write_bin_file(tmp_path / "a.bin", docs)
    seq_len, micro_bsz = 8, 3
    ds = build_internevo_dataset(
        train_folder=str(tmp_path), seq_len=seq_len, micro_bsz=micro_bsz, pack_sample_into_one=not apart, min_length=0
    )
    assert len(ds) == sum(map(len, docs)) // (seq_len * micro_bsz)
    for pack in range(len(ds)):
        tokens, labels, positions = _expected_pack(docs, pack, seq_len, micro_bsz, apart)
        sample = ds[pack]
        if apart:
            assert [t.shape for t in sample] == [(1, seq_len * micro_bsz)] * 3
            assert sample[2].flatten().tolist() == positions
        else:
            assert [t.shape for t in sample] == [(micro_bsz, seq_len)] * 2
        assert sample[0].flatten().tolist() == tokens
        assert sample[1].flatten().tolist() == labels


def test_packs_do_not_cross_files_and_each_file_drops_its_tail(folder: Path) -> None:
    ds = build_internevo_dataset(
        train_folder=str(folder), seq_len=8, micro_bsz=2, pack_sample_into_one=False, min_length=0
    )
    per_file = [sum(map(len, _documents(s, n))) // 16 for s, n in ((0, 30), (1, 25))]
    assert len(ds) == sum(per_file)
    first_of_b = ds[per_file[0]][0].flatten().tolist()
    assert first_of_b == [abs(t) for _, _, t in _stream(_documents(1, 25))[:16]]


# ---------------------------------------------------------------- documents kept apart in the model


def test_a_packed_row_gives_each_document_the_logits_it_gets_alone(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = InternLM2(num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=97)
    docs = [[5, 9, 3, 7, 1], [8, 2, 6], [4, 4, 11, 12, 13, 2, 9]]
    write_bin_file(tmp_path / "a.bin", docs)
    row = torch.tensor([t for d in docs for t in d])[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        packed = model(row, positions).logits
        alone = [model(torch.tensor(d)[None]).logits for d in docs]
        unmasked = model(row).logits
    starts = np.cumsum([0] + [len(d) for d in docs])
    for k, logits in enumerate(alone):
        torch.testing.assert_close(packed[:, starts[k] : starts[k + 1]], logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked[:, starts[1] : starts[2]], alone[1], atol=1e-3)  # the mask matters


def test_document_mask_is_block_causal() -> None:
    from internlm_offload.model.attention import Documents, document_mask

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3]])
    doc_of = [[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 1, 1, 1, 1]]
    expected = torch.tensor([[[i >= j and row[i] == row[j] for j in range(8)] for i in range(8)] for row in doc_of])[
        :, None
    ]
    assert torch.equal(document_mask(positions), expected)
    assert Documents(positions).cu_seqlens.tolist() == [0, 3, 5, 8, 12, 16]


def test_hf_models_keep_packed_documents_apart(tmp_path: Path) -> None:
    """The wrapper passes a block-causal mask; recent transformers also detect packing from positions alone."""
    pytest.importorskip("transformers")
    from internlm_offload.model.families.hf_causal_lm.model import HFCausalLM

    config = dict(
        model_type="llama",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    docs = [[5, 9, 3, 7, 1], [8, 2, 6, 7]]
    row = torch.tensor([t for d in docs for t in d])[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    for impl in ("sdpa", "eager"):
        torch.manual_seed(0)
        model = HFCausalLM(config=config, attn_impl=impl).eval()
        with torch.no_grad():
            packed = model(row, positions).logits
            second = model(torch.tensor(docs[1])[None]).logits
        torch.testing.assert_close(packed[:, 5:], second, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- validation sets


def test_validation_sets_are_named_after_their_folders_and_split_evenly(tmp_path: Path) -> None:
    for name, count in (("en", 11), ("zh", 5)):
        (tmp_path / name).mkdir()
        write_bin_file(tmp_path / name / "valid.bin", _documents(len(name) + count, count))
    sets = find_validation_sets(str(tmp_path), seq_len=16, min_length=0)
    assert [s.name for s in sets] == ["en", "zh"]
    en = sets[0]
    batches = [en.rank_batches(rank=r, world_size=2, micro_bsz=2, valid_micro_num=2) for r in range(2)]
    # 11 documents over 2 ranks: 5 each; batches of 4 documents: one batch (2 micro-batches) per rank.
    assert batches == [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]
    inputs, labels = en.sample(0)
    doc = _documents(len("en") + 11, 11)[0][:16]
    assert inputs[: len(doc)].tolist() == [abs(t) for t in doc] and inputs[len(doc) :].eq(0).all()
    expected = [t if t > 0 else IGNORE_INDEX for t in doc[1:]] + [IGNORE_INDEX] * (17 - len(doc))
    assert labels.tolist() == expected


def test_evaluation_runs_without_autograd_and_restores_train_mode(tmp_path: Path) -> None:
    from internlm_offload.device import Accelerator
    from internlm_offload.engine.evaluation import Evaluator
    from internlm_offload.offload import offload_layers

    (tmp_path / "v").mkdir()
    write_bin_file(tmp_path / "v" / "valid.bin", _documents(7, 6))
    sets = find_validation_sets(str(tmp_path), seq_len=16, min_length=0)
    torch.manual_seed(0)
    model = InternLM2(num_layers=3, hidden_size=32, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=97)
    offloader = offload_layers(model.layers, num_layers=2, accelerator=Accelerator("cpu"), min_offload_bytes=0)
    evaluator = Evaluator(
        sets, rank=0, world_size=1, micro_bsz=2, valid_micro_num=3, device=torch.device("cpu"), distributed=False
    )
    result = evaluator.evaluate(model)
    assert model.training
    assert offloader.metrics()["act_offload_offloaded_bytes"] == 0  # nothing was saved for backward, so nothing moved
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for i in range(6):
            inputs, labels = sets[0].sample(i)
            logits = model(inputs[None]).logits[0]
            loss_sum += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            count += int((labels != IGNORE_INDEX).sum())
    assert result["valid_loss"] == pytest.approx(loss_sum / count, rel=1e-6)
    assert result["valid_ppl"] == pytest.approx(np.exp(loss_sum / count), rel=1e-6)
    json.dumps(result)  # plain floats for metrics.jsonl


# ---------------------------------------------------------------- tools.tokenize


def test_tokenize_names_each_output_by_its_input_path(tmp_path: Path) -> None:
    """Same-named inputs from different folders get their own .bin (they overwrote each other by stem)."""
    from internlm_offload.tools.tokenize import main as tokenize_main

    for name, text in (("a/x.txt", "one"), ("b/x.txt", "three"), ("b/x.jsonl", '{"text": "fifteen"}'), ("c.txt", "hi")):
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_text(text)
    inputs = [str(tmp_path / "in" / name) for name in ("a/x.txt", "b/", "c.txt", "a/x.txt")]
    for run in ("first", "again"):
        assert tokenize_main([*inputs, str(tmp_path / run), "--no-eos"]) == 0
    out = tmp_path / "first"
    found = find_bin_files(str(out), "out")
    assert [p.relative_to(out).as_posix() for p in found] == ["c.bin", "a/x.bin", "b/x.jsonl.bin", "b/x.txt.bin"]
    documents = [json.loads(p.read_text())["tokens"] for p in found]  # one document each, byte tokens
    assert documents == [list(b"hi"), list(b"one"), list(b"fifteen"), list(b"three")]
    assert sorted(p.relative_to(tmp_path / "again") for p in (tmp_path / "again").rglob("*")) == sorted(
        p.relative_to(out) for p in out.rglob("*")
    )  # deterministic
    assert tokenize_main([inputs[0], str(tmp_path / "one")]) == 0 and (tmp_path / "one" / "x.bin").is_file()
