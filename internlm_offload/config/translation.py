"""What a foreign config's key translation did: the rewritten config and its keys' fates (mapped, ignored,
refused, warned about)."""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Translation:
    """The rewritten config and what happened to the InternEvo keys."""

    config: dict[str, Any]
    ignored: list[str] = field(default_factory=list)
    mapped: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
