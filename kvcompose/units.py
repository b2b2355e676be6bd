"""Byte sizes with units, as operators write them (``32GiB``, ``512 MB``, ``1073741824``)."""

from __future__ import annotations

import os
import re
from decimal import Decimal

_UNITS = {
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
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


#: The largest size: vLLM's byte counts are int64.
MAX_SIZE = 2**63 - 1


class ByteSize(int):
    """An ``int`` of bytes that option structs use for sizes; decoded from ``int`` or ``"32GiB"``.

    Sizes are exact (``1.5GiB`` is computed in decimal, not in floating point) and at most
    :data:`MAX_SIZE`: a larger number would overflow vLLM's int64 fields.
    """

    @classmethod
    def parse(cls, value: object) -> ByteSize:
        if isinstance(value, bool):
            raise ValueError(f"expected a size such as 32GiB, got {value!r}")
        if isinstance(value, int):
            if value < 0:
                raise ValueError(f"a size cannot be negative, got {value}")
            return cls(_at_most_max(value, str(value)))
        if isinstance(value, str) and len(value) <= 64:
            m = _SIZE.match(value)
            if m and m.group(2).lower() in _UNITS:
                n = int(Decimal(m.group(1)) * _UNITS[m.group(2).lower()])
                return cls(_at_most_max(n, value.strip()))
        shown = repr(value) if len(repr(value)) <= 64 else repr(value)[:64] + "..."
        raise ValueError(f"expected a size such as 32GiB, 512MiB, 8GB or a number of bytes, got {shown}")

    def __repr__(self) -> str:
        return f"ByteSize({format_size(self)})"


def format_size(n: int) -> str:
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= factor:
            return f"{n / factor:.1f}{unit}"
    return f"{int(n)}B"


def _at_most_max(n: int, written: str) -> int:
    if n > MAX_SIZE:
        raise ValueError(
            f"{written} is {n} bytes, more than any size can be ({MAX_SIZE} bytes, 8EiB; vLLM's sizes are int64)"
        )
    return n


def host_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def beyond_host_memory(n: int) -> str | None:
    """Why ``n`` bytes of host memory cannot be had here, or None when they fit."""
    total = host_memory()
    if total is None or n <= total:
        return None
    return f"{_gib(n)} ({int(n)} bytes) is more than this machine's memory, {_gib(total)} ({total} bytes)"


def _gib(n: int) -> str:
    return format_size(n) if n % 2**30 == 0 else f"{n / 2**30:.1f}GiB"
