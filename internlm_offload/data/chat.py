"""XTuner's chat data: jsonl conversations, tokenized with the model's chat template, trained where XTuner trains.

A line is one conversation (XTuner v1's OpenAI format): a bare list of messages, or `{"messages": [...]}` /
`{"dialogs": [...]}`, optionally with `"tools"`. A message has a `role` (system, developer, user, assistant,
tool, pretrain), a `content` (a string, or a list of `{"type": "text", "text": ...}` items) and an optional
`"loss": true|false`; without it assistant and pretrain messages are trained and the others are not. A
conversation of pretrain messages only, or a `{"content": ...}` line, is plain text: its tokens and eos, all
trained (XTuner's pretrain format).

Which tokens a message owns comes from the template's own rendering, never from searching the output:
message k owns the characters the rendered conversation gains when message k is added (the header a
template writes before a reply is rendered with the prompt, `add_generation_prompt=True`, so it is not the
reply's), and a token belongs to the message its first character is in (the tokenizer's offset mapping).
What the template writes before message 0 (a BOS, a default system prompt) is no message's: never trained.
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from internlm_offload.data.chat_formats import FormatError, to_messages
from internlm_offload.data.tokenized import InternEvoPackedDataset
from internlm_offload.data.tokenizer import HFTokenizer, Tokenizer
from internlm_offload.errors import DataError
from internlm_offload.log import get_logger
from internlm_offload.registry import DATASETS

logger = get_logger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool", "pretrain")
TRAINED_BY_DEFAULT = ("assistant", "pretrain")
SUFFIXES = (".jsonl", ".json")


class BadLine(ValueError):
    """A line that holds no usable conversation; the message says why."""


@dataclass
class Conversation:
    """One line's messages (role, content, loss), and the tools the template may render."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None

    @property
    def is_pretrain(self) -> bool:
        return all(m["role"] == "pretrain" for m in self.messages)


def parse_conversation(line: str, fmt: str = "messages") -> Conversation:
    """The conversation of one jsonl line in format `fmt` (`chat_formats.py`); `BadLine` naming what is wrong."""
    try:
        record = to_messages(json.loads(line), fmt)
    except json.JSONDecodeError as exc:
        raise BadLine(f"not JSON ({exc.msg})") from None
    except FormatError as exc:
        raise BadLine(str(exc)) from None
    tools = None
    if isinstance(record, dict) and isinstance(record.get("content"), str):
        record = [{"role": "pretrain", "content": record["content"]}]
    if isinstance(record, dict):
        tools = record.get("tools")
        record = record.get("messages", record.get("dialogs"))
    if not isinstance(record, list):
        raise BadLine('expected a list of messages, or an object with "messages", "dialogs" or "content"')
    if not record:
        raise BadLine("empty conversation")
    messages = [_message(m, i) for i, m in enumerate(record)]
    if not any(m["loss"] for m in messages):
        raise BadLine('nothing to train: no assistant or pretrain message, and no message with "loss": true')
    if any(m["role"] == "pretrain" for m in messages) and not all(m["role"] == "pretrain" for m in messages):
        raise BadLine("pretrain messages mixed with chat messages (a pretrain line holds pretrain messages only)")
    return Conversation(messages, tools)


def _message(raw: Any, index: int) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise BadLine(f"message {index} is not an object")
    role = raw.get("role")
    if role not in ROLES:
        raise BadLine(f"message {index} has role {role!r}; roles: {', '.join(ROLES)}")
    content = raw.get("content")
    if isinstance(content, list):
        if any(not isinstance(item, dict) or item.get("type") != "text" for item in content):
            raise BadLine(f"message {index}: only text content is read here (no images or video)")
        content = "".join(str(item.get("text", "")) for item in content)
    if not isinstance(content, str):
        raise BadLine(f"message {index} has no string content")
    loss = raw.get("loss", role in TRAINED_BY_DEFAULT)
    if not isinstance(loss, bool):
        raise BadLine(f'message {index} has "loss": {loss!r}; true or false')
    message = {key: value for key, value in raw.items() if key != "loss"}
    return {**message, "content": content, "loss": loss}


class ChatEncoder:
    """Conversations -> (token ids, is-target flags) with a Hugging Face tokenizer and a chat template.

    `tokenizer` is a transformers fast tokenizer (offsets are needed); `template` a Jinja chat template, or
    None for the tokenizer's own; conversations are cut to `max_length` tokens."""

    def __init__(self, tokenizer: Any, template: str | None, max_length: int) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise DataError("data.tokenizer: chat data needs a fast tokenizer (tokenizer.json) for its offsets")
        self.tokenizer = tokenizer
        self.template = template if template is not None else tokenizer.chat_template
        if not self.template and template is None:
            raise DataError("data.tokenizer has no chat template; set data.chat_template (a .jinja file or a template)")
        self.max_length = max_length
        self.eos_id = tokenizer.eos_token_id

    def encode(self, conversation: Conversation) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (int64) and, per token, whether it is a target."""
        if conversation.is_pretrain:
            ids = self.tokenizer.encode("".join(m["content"] for m in conversation.messages), add_special_tokens=False)
            ids = [*ids, self.eos_id] if self.eos_id is not None else ids
            is_target = np.ones(len(ids), dtype=bool)
        else:
            text, trained_chars = self._render(conversation)
            encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = encoded["input_ids"]
            starts = np.array([start for start, _ in encoded["offset_mapping"]], dtype=np.int64)
            is_target = trained_chars[np.minimum(starts, len(text) - 1)]
        ids = np.asarray(ids[: self.max_length], dtype=np.int64)
        return ids, np.asarray(is_target[: self.max_length], dtype=bool)

    def _render(self, conversation: Conversation) -> tuple[str, np.ndarray]:
        """The rendered conversation and, per character, whether its message is trained."""
        messages = [{k: v for k, v in m.items() if k != "loss"} for m in conversation.messages]
        full = self._apply(messages, generation_prompt=False, tools=conversation.tools)
        trained = np.zeros(max(len(full), 1), dtype=bool)
        for k, message in enumerate(conversation.messages):
            is_reply = message["role"] == "assistant"
            if k == 0:
                begin = self._first_begin(messages[0], is_reply, conversation.tools, full)
            else:
                begin = len(self._prefix(messages[:k], is_reply, conversation, full))
            end = len(self._prefix(messages[: k + 1], False, conversation, full))
            trained[begin:end] = message["loss"]
        return full, trained

    def _first_begin(self, first: dict, is_reply: bool, tools: list | None, full: str) -> int:
        """Where message 0's own characters start: after the template's prefix and, for a reply, after the
        header the template writes before a reply (as for later replies)."""
        prefix = self._template_prefix(first, tools, full)
        if not is_reply:
            return len(prefix)
        alone = self._apply([first], generation_prompt=False, tools=tools)
        header = self._apply([first], generation_prompt=True, tools=tools)[len(alone) :]
        return len(prefix) + len(header) if full.startswith(prefix + header) else len(prefix)

    def _template_prefix(self, first: dict, tools: list | None, full: str) -> str:
        """What the template writes before message 0 (a BOS, a default system prompt): message 0 rendered
        alone, less message 0's own span, which is what the template adds when it renders message 0 again
        after it. A template that will not render that (it enforces turn order) or renders it otherwise:
        the tokenizer's BOS where the conversation starts with it."""
        alone = self._apply([first], generation_prompt=False, tools=tools)
        try:
            twice = self._apply([first, first], generation_prompt=False, tools=tools)
        except BadLine:
            twice = ""
        span = twice[len(alone) :] if twice.startswith(alone) else ""
        prefix = alone[: len(alone) - len(span)]
        if span and alone.endswith(span) and full.startswith(prefix):
            return prefix
        bos = self.tokenizer.bos_token
        return bos if isinstance(bos, str) and bos and full.startswith(bos) else ""

    def _prefix(self, messages: list[dict], generation_prompt: bool, conversation: Conversation, full: str) -> str:
        text = self._apply(messages, generation_prompt=generation_prompt, tools=conversation.tools)
        if not full.startswith(text):
            raise BadLine(
                f"the chat template renders the first {len(messages)} message(s) differently inside the whole "
                "conversation (it rewrites earlier turns), so message spans cannot be found"
            )
        return text

    def _apply(self, messages: list[dict], *, generation_prompt: bool, tools: list | None) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=generation_prompt,
            )
        except Exception as exc:  # a template raises what its Jinja code raises
            raise BadLine(f"the chat template fails on it ({type(exc).__name__}: {exc})") from None


@dataclass
class ChatFile:
    """One jsonl file's conversations, tokenized (the packer's `DocumentFile`)."""

    path: Path
    ids: list[np.ndarray] = field(repr=False)
    is_target: list[np.ndarray] = field(repr=False)
    # computed once: the packer reads a length per chunk of every pack
    lengths: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.lengths = np.array([len(ids) for ids in self.ids], dtype=np.int64)
        self.lengths.flags.writeable = False

    def __len__(self) -> int:
        return len(self.ids)

    def targets(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.ids[index], self.is_target[index]


@dataclass
class BadLines:
    """Lines that held no usable conversation: how many, and the first few with file and line."""

    total: int = 0
    bad: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, path: Path, lineno: int, reason: str) -> None:
        self.bad += 1
        if len(self.examples) < 5:
            self.examples.append(f"{path} line {lineno}: {reason}")

    def check(self, max_fraction: float) -> None:
        """Warn about bad lines; stop (DataError) when more than `max_fraction` of the lines are bad."""
        if not self.bad:
            return
        summary = f"{self.bad} of {self.total} lines of data.paths are bad (first: {self.examples[0]})"
        if self.bad > max_fraction * self.total:
            raise DataError(f"{summary}; more than data.max_bad_fraction={max_fraction}")
        logger.warning("%s; skipped. %s", summary, " | ".join(self.examples[1:]))


def chat_files(paths: Sequence[str]) -> list[Path]:
    """The jsonl files of `data.paths`: files as given, folders' files in sorted order."""
    found = []
    for path in (Path(p) for p in ([paths] if isinstance(paths, str) else paths)):
        if not path.exists():
            raise DataError(f"data.paths: file not found: {path}")
        found += sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file()) if path.is_dir() else [path]
    if not found:
        raise DataError(f"data.paths: no .jsonl files in {list(paths)}")
    return found


def read_chat_files(
    paths: Sequence[str], encoder: ChatEncoder, max_bad_fraction: float, fmt: str = "messages"
) -> list[ChatFile]:
    """Every conversation of `paths`, tokenized, one `ChatFile` per file; bad lines counted (see `BadLines`),
    conversations cut to no label by `max_length` dropped and counted per file."""
    bad, files = BadLines(), []
    for path in chat_files(paths):
        ids, is_target, cut = [], [], 0
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as err:
            raise DataError(f"data.paths: {path} is not valid UTF-8 ({err.reason} at byte {err.start})") from None
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            bad.total += 1
            try:
                tokens, targets = encoder.encode(parse_conversation(line, fmt))
            except BadLine as exc:
                bad.add(path, lineno, str(exc))
                continue
            if not targets[1:].any():  # its trained tokens were all past max_length: no label left
                cut += 1
                continue
            ids.append(tokens)
            is_target.append(targets)
        if cut:
            logger.warning(
                "%s: %d of %d conversations have no trained token within data.max_length=%d tokens; dropped",
                path,
                cut,
                cut + len(ids),
                encoder.max_length,
            )
        files.append(ChatFile(path, ids, is_target))
    bad.check(max_bad_fraction)
    return files


def load_chat_template(value: str | None) -> str | None:
    """`data.chat_template`: None (the tokenizer's own), a .jinja file, or the template's text."""
    if value is None:
        return None
    if Path(value).is_file():
        return Path(value).read_text(encoding="utf-8")
    if "{%" in value or "{{" in value:
        return value
    raise DataError(f"data.chat_template={value!r}: neither a file nor a Jinja template")


def build_chat_dataset(
    *,
    seq_len: int,
    micro_bsz: int,
    tokenizer: Tokenizer,
    paths: Sequence[str],
    chat_template: str | None = None,
    max_length: int | None = None,
    pack_sample_into_one: bool = False,
    max_bad_fraction: float = 0.01,
    vocab_size: int | None = None,
    record_format: str = "messages",
) -> InternEvoPackedDataset:
    """XTuner's chat jsonl, packed as InternEvo packs (conversations kept apart unless `pack_sample_into_one`)."""
    if not isinstance(tokenizer, HFTokenizer):
        raise DataError(
            "data.type='chat' needs data.tokenizer, a local Hugging Face tokenizer folder (its chat template)"
        )
    encoder = ChatEncoder(tokenizer.backend, load_chat_template(chat_template), max_length or seq_len)
    files = read_chat_files(paths, encoder, max_bad_fraction, record_format)
    return InternEvoPackedDataset(
        files,
        seq_len=seq_len,
        micro_bsz=micro_bsz,
        pack_sample_into_one=pack_sample_into_one,
        source=f"data.paths: {list(paths)}",
        vocab_size=vocab_size,
    )


DATASETS.register_module(name="chat", module=build_chat_dataset)
