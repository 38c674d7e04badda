"""Memory sizes as users write them (`80GiB`, `40GB`, `512MiB` or a number of bytes) and as they are shown."""

import re
from typing import Any

SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(value: Any, key: str) -> int:
    """`80GiB`, `40GB`, `512MiB` or a number of bytes -> bytes; ValueError naming `key` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value) if isinstance(value, str) else None
    unit = match.group(2).lower() if match else None
    if match is None or unit not in SIZE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"{key}={value!r}: expected a positive size like '80GiB', '40GB', '512MiB' or bytes")
    return int(float(match.group(1)) * SIZE_UNITS[unit])


def human_bytes(nbytes: int) -> str:
    """`161.3 GiB`, `36.9 MiB`, `12.0 KiB`: the largest binary unit the size reaches (MiB below 1 GiB)."""
    size = abs(nbytes)
    if size >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    if size >= 2**20 or size == 0:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.1f} KiB" if size >= 2**10 else f"{nbytes} B"
