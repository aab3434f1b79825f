"""The state's image: what the durable record holds, each book's part written and read
by the book itself (``image`` and ``restore`` on the arena, graph-pool and KV books, and
on the state for its sessions); durable.py keeps it in the fd store.

A record's image is its own dataclass fields, enumerated from the class, so a field
added to a record is kept across a restart with no second spelling of it anywhere; a
wire struct a record holds (a round's budget, a member's capture-done report) is kept as
that struct. What cannot outlive the process (a driver's handle, a mapped segment) is
named once, where the book makes its ``Imager``, and given back where it restores; a
field that points at another record is imaged as that record's name or id. The fds the
store must hold go through two small callables, so a book never sees the store.

A snapshot of the whole state rather than a journal: a handful of arenas encode in
microseconds, and there is no replay to get wrong.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec

# Records are imaged in their classes' field order: adding, removing or reordering a
# record's fields changes the format. 3: each book's own part; a round member keeps its
# capture-done report. 4: a session keeps its client's own pid. 5: and its tenant token's digest.
# 6: an arena keeps its sleep (the sleeper book's part no longer does). 7: a retain group
# keeps when its last holder ended and the other writers its adoption waits to be fenced.
IMAGE_VERSION = 7

# A record's image: its fields' values, in the order ``Imager.names`` gives.
Image = tuple[Any, ...]
# The fd the store must hold for the record, under this name.
Keep = Callable[[str, int], None]
# The fd the store passed under this name, now the caller's; -1: none was.
Take = Callable[[str], int]

_R = TypeVar("_R")


def chunk_name(chunk_id: int) -> str:
    return f"chunk-{chunk_id}"


def lease_name(pool_id: int, moves: int = 0) -> str:
    """A pool's lease segment in the store: a new name each time the pool moves to a fresh
    segment, so that the store takes the new one and lets go of the retired one."""
    return f"lease-{pool_id}.{moves}" if moves else f"lease-{pool_id}"


class Imager(Generic[_R]):
    """The image of one record class: the values of its dataclass fields, in their
    order, but the fields ``left_out`` (what cannot outlive the process). One C call
    (attrgetter) per record: every request that changes something images every chunk."""

    def __init__(self, cls: type[_R], *left_out: str) -> None:
        self.cls = cls
        self.names = tuple(f.name for f in dataclasses.fields(cls) if f.name not in left_out)  # type: ignore[arg-type]
        self._values = operator.attrgetter(*self.names)

    def image(self, record: _R, **instead: Any) -> Image:
        """``instead``: the image of a field that cannot go as it is (a record it points at)."""
        values: Image = self._values(record)
        if instead:
            values = tuple(instead.get(name, value) for name, value in zip(self.names, values))
        return values

    def fields(self, image: Image) -> dict[str, Any]:
        if len(image) != len(self.names):
            raise msgspec.ValidationError(f"a {self.cls.__name__} image has {len(image)} fields, not {len(self.names)}")
        return dict(zip(self.names, image))

    def restore(self, image: Image | dict[str, Any], **given: Any) -> _R:
        """The record ``image`` was made of (or ``fields`` of it), with ``given`` for the
        fields left out or imaged otherwise; every field's type is checked
        (msgspec.ValidationError)."""
        fields = image if isinstance(image, dict) else self.fields(image)
        return msgspec.convert({**fields, **given} if given else fields, self.cls)


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
    # Each stored fd's identity (st_dev, st_ino) by its name, taken when it was stored: a
    # descriptor put in the store under that name by anyone else is not it.
    stored: dict[str, tuple[int, int]] | None = None
    sleepers: Any = None  # since image 3's sleep and wake: absent in an earlier record (nobody slept)
    retained: Any = None  # the retain book's part (a record written before retain groups has none)


# The ids the daemon hands out next, by book and field: each one issued is one more, and
# must stay a number msgpack, lease words and the driver take. A record whose counters
# lie beyond this was not written by a daemon (none issues 2**62 ids) and is refused
# whole, before any book restores from it. Numbers a client chose (its request ids) may
# be anything the protocol allows, and are not checked here.
COUNTER_BOUND = 1 << 62
COUNTERS = (("sessions", "next_session"), ("arenas", "next_chunk"), ("arenas", "next_grant"), ("graph_pools", "next_id"), ("kv", "next_round"))


def bad_counter(image: StateImage) -> str | None:
    """The first counter of ``image`` out of bounds, as ``part.field = value``; None: none is."""
    for part, field in COUNTERS:
        book = getattr(image, part)
        value = book.get(field) if isinstance(book, dict) else None
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < COUNTER_BOUND:
            return f"{part}.{field} = {value!r}"
    return None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StateImage)


def encode(image: StateImage) -> bytes:
    return _ENCODER.encode(image)


def decode(payload: bytes) -> StateImage:
    """The image a record's payload holds (msgspec's errors if it does not)."""
    return _DECODER.decode(payload)
