"""Byte sizes as people write them: 8GiB, 512Mi, 1.5GB, 4096.

IEC units (Ki, Mi, Gi, Ti, Pi, with or without a trailing B) are powers of 1024; SI
units (k, M, G, T, P, with or without B) are powers of 1000. Case does not matter. A
size must come to a whole number of bytes: 1.5GB is 1,500,000,000, but 1.0001KiB is
refused rather than silently rounded.
"""

from __future__ import annotations

import dataclasses
import re
from decimal import Decimal

_PREFIXES = ("k", "m", "g", "t", "p")
_UNITS: dict[str, int] = {"": 1, "b": 1}
for _power, _prefix in enumerate(_PREFIXES, start=1):
    _UNITS[_prefix] = _UNITS[_prefix + "b"] = 1000**_power
    _UNITS[_prefix + "i"] = _UNITS[_prefix + "ib"] = 1024**_power
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


@dataclasses.dataclass(frozen=True)
class Size:
    """A parsed size, with the unit as the user typed it (to answer in that unit)."""

    bytes: int
    unit: str  # as typed, e.g. "MiB", "GB", "" for plain bytes
    scale: int  # bytes per unit

    def nearest_multiples(self, step: int) -> str:
        """The positive multiples of ``step`` around this size, written in its unit."""
        below = self.bytes // step * step
        above = _in_unit(below + step, self.unit, self.scale)
        return f"{_in_unit(below, self.unit, self.scale)} or {above}" if below else above

    def as_iec(self) -> Size | None:
        """The same figure in the IEC unit when this size is written in an SI one (8G as
        8GiB): what someone who typed 8G for GPU memory most likely meant. None otherwise."""
        unit = self.unit.lower()
        if unit not in _UNITS or self.scale == 1 or self.scale % 1000:
            return None
        power = _PREFIXES.index(unit[0]) + 1
        scale = 1024**power
        exact = Decimal(self.bytes) / Decimal(self.scale) * scale
        if exact != exact.to_integral_value():
            return None
        return Size(int(exact), f"{unit[0].upper()}iB", scale)

    def __str__(self) -> str:
        return _in_unit(self.bytes, self.unit, self.scale)


def _in_unit(n: int, unit: str, scale: int) -> str:
    value = Decimal(n) / Decimal(scale)
    text = format(value.normalize(), "f") if value != value.to_integral_value() else str(int(value))
    return f"{text}{unit}"


def parse(text: str) -> Size:
    match = _SIZE.match(text)
    unit = match.group(2) if match else ""
    if not match or unit.lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 8GiB, 512Mi, 1.5GB, 1073741824)")
    scale = _UNITS[unit.lower()]
    exact = Decimal(match.group(1)) * scale
    if exact != exact.to_integral_value():
        raise ValueError(f"{text!r} is {exact} bytes: a size is a whole number of bytes")
    return Size(int(exact), unit, scale)


def parse_size(text: str) -> int:
    return parse(text).bytes


def format_size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{n} B"
