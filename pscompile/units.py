"""Byte sizes and rates: parsing ("512MiB", "2GB", "50MB/s") and formatting."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, field: str) -> int:
    """Return a byte count from an int or a string such as "512MiB" or "2GB".

    Raises ValueError naming ``field`` when the value cannot be read.
    """
    if isinstance(value, bool):
        raise ValueError(f"{field}={value!r} is not a size; use bytes (int) or a string like '512MiB'")
    if isinstance(value, (int, float)):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{field}={value!r} is not a number of bytes; give a finite size like 2 << 30 or "
                             f"'2GiB' (None means no limit)")
        if value < 0:
            raise ValueError(f"{field}={value!r} must be >= 0 bytes")
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(
        f"{field}={value!r} is not a size; use bytes (int) or a string like '512MiB', '2GB', '64KiB'")


def parse_rate(value: int | float | str, field: str) -> float:
    """Return bytes per second from a number or a string such as "50MB/s"."""
    if isinstance(value, str):
        text = value.strip()
        if text.lower().endswith("/s"):
            text = text[:-2]
        rate = parse_size(text, field)
    else:
        rate = parse_size(value, field)
    if rate <= 0:
        raise ValueError(f"{field}={value!r} must be a positive rate such as '50MB/s'")
    return float(rate)


def format_bytes(n: int | float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
