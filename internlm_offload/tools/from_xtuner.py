"""Translate an XTuner config (v1 or classic) into this trainer's config, with one report of every field not carried.

    python -m internlm_offload.tools.from_xtuner XTUNER_CONFIG.py [--out OUT.py]

A classic config (`model = dict(type=SupervisedFinetune, llm=..., lora=...)`, no `trainer`) runs with stand-ins
for xtuner, mmengine, transformers, peft and datasets and is mapped by `xtuner/classic.py` (docs/lora.md).

The file runs as XTuner runs it (environment variables read as XTuner reads them), with recorders standing
in for the `xtuner.v1` names it imports unless XTuner is installed (`xtuner/standins.py`). Its `trainer`
is mapped by `xtuner/translate.py`: the report lists what was carried (XTuner field -> key here) and what
was dropped and why. The result is validated as `train.py` validates it, then written to OUT.py (or
printed); train it with `python train.py --config OUT.py --work-dir <XTuner's work_dir>`.
Exit codes: 0 written, 2 a field that cannot be carried without changing the training (nothing written).
"""

import argparse
import sys
from pathlib import Path
from pprint import pformat
from typing import Any

from internlm_offload.config import ConfigError
from internlm_offload.xtuner.classic import translate_classic
from internlm_offload.xtuner.standins import is_classic, load_classic, load_trainer
from internlm_offload.xtuner.translate import Translation, translate_trainer, validate


def render(config: dict[str, Any], source: Path, t: Translation) -> str:
    """The translated config as a config file: plain dicts, the report as comments."""
    lines = [f"# Translated from the XTuner config {source} by internlm_offload.tools.from_xtuner."]
    lines += [f"# carried: {line}" for line in t.carried] + [f"# dropped: {line}" for line in t.dropped]
    for key, value in sorted(config.items(), key=lambda item: item[0] != "JOB_NAME"):
        lines.append(f"{key} = {pformat(value, width=110, sort_dicts=False)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "config",
        type=Path,
        help="an XTuner config: v1 (`trainer = TrainerConfig(...)`) or classic (`model = dict(...)`)",
    )
    parser.add_argument("--out", type=Path, help="where to write the translated config (default: print it)")
    args = parser.parse_args(argv)
    try:
        classic = is_classic(args.config)
        loaded = load_classic(args.config) if classic else load_trainer(args.config)
    except Exception as exc:  # the user's config code raises whatever it raises
        print(f"error: {args.config}: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    t = translate_classic(loaded, args.config) if classic else translate_trainer(loaded, args.config)
    for line in t.carried:
        print(f"carried: {line}", file=sys.stderr)
    for line in t.dropped:
        print(f"dropped: {line}", file=sys.stderr)
    if not t.fatal:
        try:
            validate(t.config)
        except ConfigError as exc:
            t.fatal.append(f"the translation does not validate: {exc}")
    if t.fatal:
        print(f"error: {args.config} cannot be carried over: {'; '.join(t.fatal)}", file=sys.stderr)
        return 2
    text = render(t.config, args.config, t)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}: python train.py --config {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
