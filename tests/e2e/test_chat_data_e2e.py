"""XTuner's data through train.py: chat jsonl trains, and trains exactly as its `tools.tokenize --chat`
`.bin` folder does; pretrain `{"content": ...}` jsonl trains; a file of bad lines stops in one line."""

import json
import random
import sys
from pathlib import Path

import pytest
from chat_fixtures import WORDS, save_chatml_tokenizer
from runner import losses, run_python, train
from test_bad_input import assert_clean_error

pytestmark = pytest.mark.e2e


def conversation(rng: random.Random) -> list[dict]:
    """A random exchange of 1-3 turns over the tokenizer's plain words, sometimes with a system message."""
    words = WORDS[4:]
    say = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))  # noqa: E731
    messages = [{"role": "system", "content": say()}] if rng.random() < 0.3 else []
    for _ in range(rng.randint(1, 3)):
        messages += [{"role": "user", "content": say()}, {"role": "assistant", "content": say()}]
    return messages


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("chat")
    rng = random.Random(0)
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps({"messages": conversation(rng)}) + "\n" for _ in range(120)))
    return save_chatml_tokenizer(root / "tokenizer"), data


def chat_options(tokenizer: Path, data: Path) -> list[str]:
    return ["data.type=chat", f"data.tokenizer={tokenizer}", f"data.paths=[{str(data)!r}]", "data.total_steps=3"]


def test_chat_jsonl_trains_as_its_tokenized_bin_folder(chat_data, tmp_path):
    tokenizer, data = chat_data
    train(tmp_path / "jsonl", *chat_options(tokenizer, data))
    out = tmp_path / "bin"
    command = [sys.executable, "-m", "internlm_offload.tools.tokenize", str(data), str(out), "--tokenizer",
               str(tokenizer), "--chat", "--max-length", "64"]  # fmt: skip
    assert run_python(command).returncode == 0
    train(tmp_path / "bin_run", f"data.train_folder={out}", "data.total_steps=3")
    from_jsonl = losses(tmp_path / "jsonl")
    assert sorted(from_jsonl) == [1, 2, 3] and from_jsonl == losses(tmp_path / "bin_run")


def test_pretrain_content_jsonl_trains(chat_data, tmp_path):
    tokenizer, _ = chat_data
    rng = random.Random(1)
    data = tmp_path / "pretrain.jsonl"
    data.write_text("".join(json.dumps({"content": " ".join(rng.choices(WORDS[4:], k=30))}) + "\n" for _ in range(40)))
    train(tmp_path / "run", "data.type=text", f"data.tokenizer={tokenizer}", f"data.paths=[{str(data)!r}]",
          "data.total_steps=3")  # fmt: skip
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3]


def test_chat_data_of_bad_lines_stops_in_one_line(chat_data, tmp_path):
    tokenizer, _ = chat_data
    data = tmp_path / "bad.jsonl"
    data.write_text('{"messages": [{"role": "robot", "content": "hi"}]}\n' * 3)
    proc = train(tmp_path / "run", *chat_options(tokenizer, data), check=False)
    assert_clean_error(proc, "3 of 3 lines of data.paths are bad", "bad.jsonl line 1: message 0 has role 'robot'")
    assert not (tmp_path / "run" / "checkpoints").exists()
