"""The state's image: what the durable record holds, each book's part written and read
by the book itself (``image`` and ``restore`` on the arena, graph-pool and KV books, and
on the state for its sessions); durable.py keeps it in the fd store.

A record's image is its own dataclass fields by name, so a field added to a record is
kept across a restart with no second spelling of it anywhere; a wire struct a record
holds (a round's budget, a member's capture-done report) is kept as that struct. What a
field holds that cannot outlive the process (a driver's handle, a mapped segment) or
that points at another record is named where the book images it (``image_of``'s
``instead``) and given back where it restores (``restored``'s ``given``). The fds the
store must hold go through two small callables, so a book never sees the store.

A snapshot of the whole state rather than a journal: a handful of arenas encode in
microseconds, and there is no replay to get wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

IMAGE_VERSION = 3  # 3: each book's part, records by field name; a member keeps its capture-done report

Image = dict[str, Any]
# The fd the store must hold for the record, under this name.
Keep = Callable[[str, int], None]
# The fd the store passed under this name, now the caller's; -1: none was.
Take = Callable[[str], int]

# ``image_of``'s mark for a field that does not go into the record.
LEFT_OUT: Any = object()

_R = TypeVar("_R")


def chunk_name(chunk_id: int) -> str:
    return f"chunk-{chunk_id}"


def lease_name(pool_id: int) -> str:
    return f"lease-{pool_id}"


def image_of(record: Any, **instead: Any) -> Image:
    """``record``'s fields by name; ``instead`` gives the image of a field that cannot
    go as it is (LEFT_OUT: not at all). A record's instance dict holds its fields and
    nothing else, and copying it is one call: every request that changes something
    images every chunk."""
    out: Image = dict(record.__dict__)
    for name, value in instead.items():
        if value is LEFT_OUT:
            del out[name]
        else:
            out[name] = value
    return out


def restored(cls: type[_R], image: Image, **given: Any) -> _R:
    """The record ``image`` was made of, with ``given`` for the fields left out or
    imaged otherwise; every field's type is checked (msgspec.ValidationError)."""
    return msgspec.convert({**image, **given} if given else image, cls)


class StateImage(msgspec.Struct, array_like=True):
    """The record's payload. The first five fields stay where they are in every version:
    a record of another version or daemon is recognized and refused by them."""

    version: int
    device_uuid: str
    backend: str
    va_base: int
    generation: int
    sessions: Any = None  # each book's part, read by the book
    arenas: Any = None
    graph_pools: Any = None
    kv: Any = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StateImage)


def encode(image: StateImage) -> bytes:
    return _ENCODER.encode(image)


def decode(payload: bytes) -> StateImage:
    """The image a record's payload holds (msgspec's errors if it does not)."""
    return _DECODER.decode(payload)
