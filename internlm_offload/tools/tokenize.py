"""Tokenize .txt/.jsonl documents into InternEvo's `.bin` + `.bin.meta` format (what `data.train_folder` reads).

    python -m internlm_offload.tools.tokenize INPUT [INPUT ...] OUT_DIR [--tokenizer byte|HF_DIR] [--no-eos]
    python -m internlm_offload.tools.tokenize CHAT.jsonl [...] OUT_DIR --tokenizer HF_DIR --chat
        [--chat-template FILE] [--chat-format messages|alpaca|oasst1] [--max-length N] [--max-bad-fraction F]

INPUT files and folders are read as `data.paths` reads them (a .txt file is one document, a .jsonl line
with a "text" or "content" field is one). Each input file becomes a `.bin` with its `.bin.meta` at its path
below the inputs' common folder (`a/x.txt b/x.txt` -> `OUT_DIR/a/x.bin`, `OUT_DIR/b/x.bin`; one file or
one folder's files: `OUT_DIR/x.bin`), keeping its suffix where two would meet (`x.txt.bin`, `x.jsonl.bin`);
every document gets the tokenizer's eos appended unless `--no-eos`. With `--chat` the lines are XTuner's
conversations, tokenized and masked as `data.type="chat"` does (`data/chat.py`); tokens that are not targets
are written negative, InternEvo's "no loss" mark, so `data.train_folder` trains on the same labels (as in
InternEvo, token id 0 is never a target). Exit codes: 0 written, 2 bad input.
"""

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from internlm_offload.data.chat import ChatEncoder, load_chat_template, read_chat_files
from internlm_offload.data.chat_formats import FORMATS
from internlm_offload.data.corpus import DataError, read_documents
from internlm_offload.data.tokenized import write_bin_file
from internlm_offload.data.tokenizer import HFTokenizer, build_tokenizer


def tokenize_files(inputs: list[str], out_dir: Path, tokenizer_name: str, add_eos: bool) -> list[Path]:
    """Write one .bin/.bin.meta pair per input file; returns the .bin paths."""
    tokenizer = build_tokenizer(tokenizer_name)
    files = list(dict.fromkeys(f.resolve() for path in inputs for f in _files(Path(path))))
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for file, target in zip(files, output_paths(files, out_dir)):
        eos = [tokenizer.eos_id] if add_eos else []
        documents = [tokenizer.encode(text) + eos for text in read_documents([str(file)])]
        target.parent.mkdir(parents=True, exist_ok=True)
        write_bin_file(target, documents)
        written.append(target)
    return written


def output_paths(files: list[Path], out_dir: Path) -> list[Path]:
    """One `.bin` path per input file (resolved, distinct): its path below the files' common folder, suffix
    swapped for `.bin`, or kept before it where two files differ only in their suffix."""
    if not files:
        return []
    common = Path(os.path.commonpath([f.parent for f in files]))
    stems = [f.relative_to(common).with_suffix("") for f in files]
    meets = {stem for stem in stems if stems.count(stem) > 1}
    return [
        out_dir / (f"{rel}.bin" if stem in meets else f"{stem}.bin")
        for f, stem, rel in zip(files, stems, (f.relative_to(common) for f in files))
    ]


def tokenize_chat_files(
    inputs: list[str],
    out_dir: Path,
    tokenizer_name: str,
    template: str | None,
    max_length: int,
    max_bad_fraction: float,
    fmt: str = "messages",
) -> list[Path]:
    """Write one .bin/.bin.meta pair per chat jsonl file, non-targets negative; returns the .bin paths."""
    tokenizer = build_tokenizer(tokenizer_name)
    if not isinstance(tokenizer, HFTokenizer):
        raise DataError("--chat needs --tokenizer, a local Hugging Face tokenizer folder (its chat template)")
    encoder = ChatEncoder(tokenizer.backend, load_chat_template(template), max_length)
    chats = {chat.path.resolve(): chat for chat in read_chat_files(inputs, encoder, max_bad_fraction, fmt)}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for chat, target in zip(chats.values(), output_paths(list(chats), out_dir)):
        target.parent.mkdir(parents=True, exist_ok=True)
        write_bin_file(target, [np.where(is_target, ids, -ids) for ids, is_target in zip(chat.ids, chat.is_target)])
        written.append(target)
    return written


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix in (".txt", ".jsonl"))
    return [path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help=".txt/.jsonl files or folders of them")
    parser.add_argument("out_dir", type=Path, help="folder for the .bin/.bin.meta files")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a local Hugging Face tokenizer folder")
    parser.add_argument("--no-eos", action="store_true", help="do not append eos to each document")
    parser.add_argument("--chat", action="store_true", help="the inputs are XTuner chat jsonl (data.type='chat')")
    parser.add_argument("--chat-template", help="--chat: a .jinja file or template (default: the tokenizer's)")
    parser.add_argument(
        "--chat-format", default="messages", choices=FORMATS, help="--chat: the lines' format (data.chat_format)"
    )
    parser.add_argument("--max-length", type=int, default=4096, help="--chat: tokens kept per conversation")
    parser.add_argument("--max-bad-fraction", type=float, default=0.01, help="--chat: bad lines tolerated")
    args = parser.parse_args(argv)
    if args.out_dir.exists() and not args.out_dir.is_dir():
        print(f"error: OUT_DIR {args.out_dir} is a file", file=sys.stderr)
        return 2
    try:
        if args.chat:
            written = tokenize_chat_files(
                args.inputs,
                args.out_dir,
                args.tokenizer,
                args.chat_template,
                args.max_length,
                args.max_bad_fraction,
                args.chat_format,
            )
        else:
            written = tokenize_files(args.inputs, args.out_dir, args.tokenizer, add_eos=not args.no_eos)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
