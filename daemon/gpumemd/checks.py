"""Checks of request fields more than one book applies: names and sizes."""

from __future__ import annotations

import re

from gpumem_shared import protocol as p

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}\Z")


def check_name(name: str, what: str) -> None:
    if not _NAME.match(name):
        raise p.ProtocolError(
            p.ErrorCode.INVALID_ARGUMENT, f"{what} {name!r} is not valid: 1-128 characters of letters, digits and ._:@+-"
        )


def check_size(value: int, what: str, granularity: int, *, allow_zero: bool) -> None:
    g = granularity
    if value < 0 or (value == 0 and not allow_zero):
        raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"{what} must be positive, not {value}", **{what: value})
    if value % g:
        raise p.ProtocolError(
            p.ErrorCode.INVALID_ARGUMENT,
            f"{what} {value} is not a multiple of the device granularity {g} "
            f"(nearest valid: {value // g * g} or {(value // g + 1) * g})",
            **{what: value, "granularity": g},
        )
