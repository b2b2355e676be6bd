"""Byte sizes with units, as operators write them (``32GiB``, ``512 MB``, ``1073741824``)."""

from __future__ import annotations

import re

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


class ByteSize(int):
    """An ``int`` of bytes that option structs use for sizes; decoded from ``int`` or ``"32GiB"``."""

    @classmethod
    def parse(cls, value: object) -> ByteSize:
        if isinstance(value, bool):
            raise ValueError(f"expected a size such as 32GiB, got {value!r}")
        if isinstance(value, int):
            if value < 0:
                raise ValueError(f"a size cannot be negative, got {value}")
            return cls(value)
        if isinstance(value, str):
            m = _SIZE.match(value)
            if m and m.group(2).lower() in _UNITS:
                return cls(int(float(m.group(1)) * _UNITS[m.group(2).lower()]))
        raise ValueError(f"expected a size such as 32GiB, 512MiB, 8GB or a number of bytes, got {value!r}")

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
