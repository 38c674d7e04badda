"""XTuner's classic dataset formats read as messages: what its `alpaca_map_fn`, `oasst1_map_fn` and
`openai_map_fn` make of a jsonl line, as the roles and contents this trainer's chat data holds.

`messages` is XTuner v1's OpenAI format, read by `chat.py` itself; the others are turned into it here:
- `alpaca`: `{"instruction", "input", "output"}` is one exchange, the user turn `"{instruction}\n{input}"` (the
  newline even with no input, as XTuner writes it) after XTuner's alpaca system prompt; an output of
  `<nooutput>` holds nothing to train.
- `oasst1`: `{"text": "### Human: ... ### Assistant: ..."}`, split on `###` into alternating turns; a last
  question with no answer is dropped (it would train nothing).
"""

from typing import Any

# XTuner's SYSTEM_TEMPLATE.alpaca: the system prompt its alpaca_map_fn gives every example.
ALPACA_SYSTEM = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n"
)
FORMATS = ("messages", "alpaca", "oasst1")


class FormatError(ValueError):
    """A record that is not of the named format; the message says why."""


def to_messages(record: Any, fmt: str) -> Any:
    """The record as `chat.py` reads it: unchanged for `messages`, a list of messages for the others."""
    if fmt == "messages":
        return record
    if not isinstance(record, dict):
        raise FormatError(f"a {fmt} line is a JSON object")
    return _alpaca(record) if fmt == "alpaca" else _oasst1(record)


def _alpaca(record: dict[str, Any]) -> list[dict[str, str]]:
    instruction, extra, output = (record.get(key, "") for key in ("instruction", "input", "output"))
    if not all(isinstance(value, str) for value in (instruction, extra, output)):
        raise FormatError('alpaca: "instruction", "input" and "output" are strings')
    if output == "<nooutput>":
        raise FormatError('alpaca: "output" is "<nooutput>" (XTuner drops it too)')
    return [
        {"role": "system", "content": ALPACA_SYSTEM},
        {"role": "user", "content": f"{instruction}\n{extra}"},
        {"role": "assistant", "content": output},
    ]


def _oasst1(record: dict[str, Any]) -> list[dict[str, str]]:
    text = record.get("text")
    if not isinstance(text, str):
        raise FormatError('oasst1: no string "text"')
    turns = []
    for part in (p.strip() for p in text.strip().split("###")):
        for speaker, role in (("Human:", "user"), ("Assistant:", "assistant")):
            if part.startswith(speaker):
                turns.append({"role": role, "content": part[len(speaker) :].strip()})
    if len(turns) % 2:
        turns.pop()  # a question with no answer trains nothing
    return turns
