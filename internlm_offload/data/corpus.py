"""Where documents come from: the text that ships with CPython, or local .txt / .jsonl files."""

import json
from collections.abc import Sequence
from pathlib import Path

from internlm_offload.errors import DataError

SUFFIXES = (".txt", ".jsonl")


def builtin_documents() -> list[str]:
    """Return CPython's pydoc help topics (~465 KB of English), in sorted key order."""
    # Ships with every CPython, so the default run needs no download; sorting keys makes the order
    # independent of dict construction order in the generated module.
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def read_documents(paths: Sequence[str]) -> list[str]:
    """Read documents from .txt files (one per file), .jsonl files (one per line) and directories of them."""
    if isinstance(paths, str):  # a bare string would otherwise be read character by character
        paths = [paths]
    documents: list[str] = []
    for path in paths:
        for file in _expand(Path(path)):
            documents.extend(_read_file(file))
    if not documents:
        raise DataError(f"data.paths: no documents found in {list(paths)}")
    return documents


def _expand(path: Path) -> list[Path]:
    """Return the file itself, or a directory's .txt/.jsonl files in sorted order."""
    if not path.exists():
        raise DataError(f"data.paths: file not found: {path}")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise DataError(f"data.paths: directory has no {' or '.join(SUFFIXES)} files: {path}")
        return files
    if path.suffix not in SUFFIXES:
        raise DataError(f"data.paths: unsupported file type {path.suffix!r} for {path}; allowed: {', '.join(SUFFIXES)}")
    return [path]


def _read_text(file: Path) -> str:
    """Read a file as UTF-8, turning a decode failure into a DataError naming the file."""
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"data.paths: {file} is not valid UTF-8 ({err.reason} at byte {err.start})") from None


def _read_file(file: Path) -> list[str]:
    """Return the non-empty documents of one .txt or .jsonl file."""
    text = _read_text(file)
    if file.suffix == ".txt":
        return [text] if text else []
    return _parse_jsonl(file, text)


def _parse_jsonl(file: Path, text: str) -> list[str]:
    """Return the "text" (or XTuner's pretrain "content") field of every non-blank line, naming file and line
    on a bad one."""
    documents = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"data.paths: {file} line {lineno}: not valid JSON ({err.msg})") from None
        document = record.get("text", record.get("content")) if isinstance(record, dict) else None
        if not isinstance(document, str):
            raise DataError(f'data.paths: {file} line {lineno}: expected an object with a string "text" or "content"')
        if document:
            documents.append(document)
    return documents
