"""XTuner's chat data: labels only on the trained messages' tokens, checked against arrays written out by
hand for a tokenizer built here (word-level, ChatML template; no download)."""

import json
from pathlib import Path

import pytest
import torch

from chat_fixtures import BOS_PREFIX_IDS, TWO_TURN_IDS, TWO_TURN_LABELS, TWO_TURNS, X, save_chatml_tokenizer

from internlm_offload.data import DataError, build_chat_dataset, build_internevo_dataset
from internlm_offload.data.chat import BadLine, ChatEncoder, parse_conversation, read_chat_files
from internlm_offload.data.tokenizer import HFTokenizer
from internlm_offload.tools.tokenize import main as tokenize_main


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_chatml_tokenizer(tmp_path_factory.mktemp("tok") / "chatml")


@pytest.fixture(scope="module")
def encoder(tokenizer_dir: Path) -> ChatEncoder:
    return ChatEncoder(HFTokenizer(str(tokenizer_dir)).backend, None, max_length=64)


def labels_of(encoder: ChatEncoder, record) -> tuple[list[int], list[int]]:
    ids, is_target = encoder.encode(parse_conversation(json.dumps(record)))
    labels = [int(ids[i + 1]) if is_target[i + 1] else X for i in range(len(ids) - 1)] + [X]
    return ids.tolist(), labels


@pytest.mark.parametrize("form", ["list", "messages", "dialogs"])
def test_two_turns_train_only_the_assistant_tokens(encoder, form):
    record = {"list": TWO_TURNS, "messages": {"messages": TWO_TURNS}, "dialogs": {"dialogs": TWO_TURNS}}[form]
    assert labels_of(encoder, record) == (TWO_TURN_IDS, TWO_TURN_LABELS)


def test_per_message_loss_flags_override_the_role_defaults(encoder):
    turns = [dict(TWO_TURNS[0]), {**TWO_TURNS[1], "loss": False}, {**TWO_TURNS[2], "loss": True}, TWO_TURNS[3]]
    # the first reply is not trained; the second question is, with its header and <|im_end|>
    expected = [X] * 8 + [1, 4, 10, 11, 12, 2] + [X, X, 13, 14, 2, X]
    assert labels_of(encoder, turns) == (TWO_TURN_IDS, expected)


def test_a_system_message_is_context_and_pretrain_lines_train_every_token_with_eos(encoder):
    system = [{"role": "system", "content": "be brief"}, *TWO_TURNS[:2]]
    ids, labels = labels_of(encoder, system)
    assert ids == [1, 6, 15, 16, 2, *TWO_TURN_IDS[:9]] and labels == [X] * 10 + [8, 9, 2, X]
    for line in ({"content": "hello there"}, {"messages": [{"role": "pretrain", "content": "hello there"}]}):
        assert labels_of(encoder, line) == ([7, 9, 3], [9, 3, X])


@pytest.fixture(scope="module")
def bos_encoder(tmp_path_factory: pytest.TempPathFactory) -> ChatEncoder:
    folder = save_chatml_tokenizer(tmp_path_factory.mktemp("tok") / "bos", bos=True)
    return ChatEncoder(HFTokenizer(str(folder)).backend, None, max_length=64)


@pytest.mark.parametrize(
    "first, labels",
    [
        # a trained question: from its own header on, not the BOS and default system prompt before it
        ({**TWO_TURNS[0], "loss": True}, [X] * 5 + [1, 4, 7, 2] + [X, X, 8, 9, 2, X]),
        (TWO_TURNS[0], [X] * 11 + [8, 9, 2, X]),
    ],
)
def test_the_templates_bos_and_default_system_prompt_are_never_trained(bos_encoder, first, labels):
    assert labels_of(bos_encoder, [first, TWO_TURNS[1]]) == (BOS_PREFIX_IDS + TWO_TURN_IDS[:9], labels)
    _, is_target = bos_encoder.encode(parse_conversation(json.dumps([first, TWO_TURNS[1]])))
    assert not is_target[: len(BOS_PREFIX_IDS)].any()  # tools.tokenize --chat writes them negative


def test_a_template_that_enforces_turn_order_has_its_bos_as_prefix(bos_encoder):
    """It refuses to render message 0 twice (Gemma's and Llama 2's raise), so its prefix is the BOS it starts with."""
    alternating = (
        "{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    encoder = ChatEncoder(bos_encoder.tokenizer, alternating, max_length=64)
    ids, is_target = encoder.encode(parse_conversation(json.dumps([{**TWO_TURNS[0], "loss": True}, TWO_TURNS[1]])))
    assert ids.tolist() == BOS_PREFIX_IDS[:1] + TWO_TURN_IDS[:9]
    assert is_target.tolist() == [False] + [True] * 4 + [False] * 2 + [True] * 3


def test_a_first_reply_trains_from_its_text_as_every_reply(bos_encoder):
    """Message 0 an assistant reply: the template's prefix and the reply header are context."""
    ids, labels = labels_of(bos_encoder, [TWO_TURNS[1]])
    assert ids == BOS_PREFIX_IDS + TWO_TURN_IDS[4:9] and labels == [X] * 7 + [8, 9, 2, X]


def test_a_system_message_0_replaces_the_default_and_only_the_bos_is_the_prefix(bos_encoder):
    ids, labels = labels_of(bos_encoder, [{"role": "system", "content": "ok", "loss": True}, *TWO_TURNS[:2]])
    assert ids == [BOS_PREFIX_IDS[0], 1, 6, 17, 2, *TWO_TURN_IDS[:9]]
    assert labels == [1, 6, 17, 2] + [X] * 6 + [8, 9, 2, X]


@pytest.mark.parametrize(
    "line, reason",
    [
        ("{not json", "not JSON"),
        ("[]", "empty conversation"),
        ('[{"role": "robot", "content": "hi"}]', "message 0 has role 'robot'"),
        ('[{"role": "user", "content": "hi"}]', "nothing to train"),
        ('{"text": "hi"}', 'expected a list of messages, or an object with "messages"'),
        ('[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "loss": "yes"}]', "true or false"),
        ('[{"role": "user", "content": [{"type": "image_url"}]}, {"role": "assistant", "content": "x"}]', "only text"),
    ],
)
def test_a_bad_line_says_why(line, reason):
    with pytest.raises(BadLine, match=reason):
        parse_conversation(line)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat_dataset(tokenizer_dir: Path, paths, **kwargs):
    tok = HFTokenizer(str(tokenizer_dir))
    options = dict(seq_len=10, micro_bsz=2, tokenizer=tok, paths=[str(p) for p in paths], max_length=20)
    return build_chat_dataset(**{**options, **kwargs})


def test_a_pack_keeps_conversations_apart_with_their_labels(tmp_path, tokenizer_dir):
    data = write_jsonl(tmp_path / "sft.jsonl", [TWO_TURNS])
    (tokens, labels, positions) = chat_dataset(tokenizer_dir, [data])[0]
    assert tokens.flatten().tolist() == TWO_TURN_IDS and labels.flatten().tolist() == TWO_TURN_LABELS
    assert positions.flatten().tolist() == list(range(10)) * 2  # restart every seq_len, as InternEvo's packs


def test_bad_lines_are_counted_and_stop_the_run_above_the_fraction(tmp_path, tokenizer_dir, caplog):
    data = write_jsonl(tmp_path / "sft.jsonl", [TWO_TURNS, "{oops", [], TWO_TURNS])
    with pytest.raises(
        DataError, match=r"2 of 4 lines .* are bad \(first: .*sft.jsonl line 2: not JSON.*max_bad_fraction=0.01"
    ):
        chat_dataset(tokenizer_dir, [data])
    dataset = chat_dataset(tokenizer_dir, [data], max_bad_fraction=0.5)
    assert len(dataset) == 2 and "sft.jsonl line 3: empty conversation" in caplog.text
    with pytest.raises(DataError, match="needs data.tokenizer, a local Hugging Face tokenizer folder"):
        build_chat_dataset(seq_len=10, micro_bsz=2, tokenizer=object(), paths=[str(data)])


def test_tokenized_chat_bin_files_give_the_jsonl_paths_labels_pack_by_pack(tmp_path, tokenizer_dir):
    """tools/tokenize --chat writes non-targets negative; data.train_folder then trains on the same labels."""
    lines = [TWO_TURNS, [{**m, "loss": m["role"] == "user"} for m in TWO_TURNS], {"content": "hello there"}] * 5
    data = write_jsonl(tmp_path / "sft.jsonl", lines)
    out = tmp_path / "bin"
    args = [str(data), str(out), "--tokenizer", str(tokenizer_dir), "--chat", "--max-length", "20"]
    assert tokenize_main(args) == 0
    from_jsonl = chat_dataset(tokenizer_dir, [data], seq_len=8, micro_bsz=3)
    from_bin = build_internevo_dataset(
        seq_len=8, micro_bsz=3, train_folder=str(out), pack_sample_into_one=False, min_length=0
    )
    assert len(from_jsonl) == len(from_bin) > 3
    for pack in range(len(from_bin)):
        assert all(torch.equal(a, b) for a, b in zip(from_jsonl[pack], from_bin[pack])), pack


def test_a_chat_files_lengths_are_computed_once(tmp_path, tokenizer_dir):
    """The packer reads `lengths` for every chunk of every pack: one array, built when the file is read."""
    data = write_jsonl(tmp_path / "sft.jsonl", [TWO_TURNS, TWO_TURNS[:2]])
    encoder = ChatEncoder(HFTokenizer(str(tokenizer_dir)).backend, None, max_length=64)
    (chat,) = read_chat_files([str(data)], encoder, max_bad_fraction=0.0)
    assert chat.lengths is chat.lengths and chat.lengths.tolist() == [20, 9]
    assert not chat.lengths.flags.writeable


def test_conversations_cut_to_no_label_are_dropped_and_counted_per_file(tmp_path, tokenizer_dir, caplog):
    """max_length=8 keeps the first reply of TWO_TURNS; a reply after a long question is cut away entirely."""
    long_question = [{"role": "user", "content": "how are you fine thanks"}, {"role": "assistant", "content": "ok"}]
    data = write_jsonl(tmp_path / "sft.jsonl", [TWO_TURNS, long_question, long_question])
    other = write_jsonl(tmp_path / "other.jsonl", [TWO_TURNS])
    encoder = ChatEncoder(HFTokenizer(str(tokenizer_dir)).backend, None, max_length=8)
    sft, kept = read_chat_files([str(data), str(other)], encoder, max_bad_fraction=0.0)
    assert len(sft) == len(kept) == 1 and sft.ids[0].tolist() == TWO_TURN_IDS[:8]
    assert caplog.text.count("dropped") == 1
    assert "sft.jsonl: 2 of 3 conversations have no trained token within data.max_length=8 tokens" in caplog.text
