"""A chat tokenizer built here (word-level, ChatML specials and template; no download) and a two-turn
conversation with its token ids and labels written out by hand; shared by the unit and e2e tests. A second
one has a BOS and a template that writes it and a default system prompt before the first message."""

from pathlib import Path

X = -100  # no label
WORDS = ["[UNK]", "<|im_start|>", "<|im_end|>", "</s>", "user", "assistant", "system", "hello", "hi", "there",
         "how", "are", "you", "fine", "thanks", "be", "brief", "ok"]  # fmt: skip
ID = {word: i for i, word in enumerate(WORDS)}
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TWO_TURNS = [
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi there"},
    {"role": "user", "content": "how are you"},
    {"role": "assistant", "content": "fine thanks"},
]
# <|im_start|> user hello <|im_end|> | <|im_start|> assistant hi there <|im_end|> | <|im_start|> user how are
# you <|im_end|> | <|im_start|> assistant fine thanks <|im_end|>
TWO_TURN_IDS = [1, 4, 7, 2, 1, 5, 8, 9, 2, 1, 4, 10, 11, 12, 2, 1, 5, 13, 14, 2]
# Token i's label is token i+1 when that one is a target: the replies and their <|im_end|>, not the headers.
TWO_TURN_LABELS = [X, X, X, X, X, 8, 9, 2, X, X, X, X, X, X, X, X, 13, 14, 2, X]


BOS = len(WORDS)  # "<s>", only in the BOS tokenizer's vocabulary
# Qwen2.5's shape (a default system prompt unless message 0 is a system message) after Llama's BOS.
BOS_DEFAULT_SYSTEM = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|im_start|>system\nbe brief<|im_end|>\n{% endif %}"
    + CHATML
)
# <s> | <|im_start|> system be brief <|im_end|>: what the template writes before message 0
BOS_PREFIX_IDS = [BOS, 1, 6, 15, 16, 2]


def save_chatml_tokenizer(path: Path, bos: bool = False) -> Path:
    """A word-level fast tokenizer over WORDS with the ChatML template, saved as a transformers folder; with
    `bos`, a "<s>" BOS and the BOS_DEFAULT_SYSTEM template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={**ID, "<s>": BOS} if bos else ID, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="</s>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if bos:
        fast.add_special_tokens({"bos_token": "<s>"})
    fast.chat_template = BOS_DEFAULT_SYSTEM if bos else CHATML
    fast.save_pretrained(path)
    return path
