"""What every message is built from: the two bases, and the value types several
messages carry (device, chunk and arena views, extents, a round's budget)."""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from gpumem_shared.protocol.codes import MAX_POOL_EXTENTS, MsgType


class Message(msgspec.Struct):
    """A struct on the wire: a msgpack map with one key per field. Unknown keys are
    skipped when decoding (a newer minor may add fields)."""


class RequestMessage(Message, kw_only=True):
    """A request: its message type, its reply type and how the daemon admits it are
    class constants, read by the codec and the daemon's dispatcher."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type[Message]]
    # False only for what an anonymous control-channel peer (gpumemctl) may ask.
    NEEDS_SESSION: ClassVar[bool] = True
    # True for what a stopping daemon still serves: looking, and giving memory back.
    WHILE_STOPPING: ClassVar[bool] = False


class DeviceInfo(Message):
    index: int  # the daemon's device index (nvidia-smi order)
    uuid: str  # "GPU-..." for CUDA, "HOST-..." for the host backend
    name: str
    total_bytes: int
    granularity: int  # every size on the wire is a multiple of this


class ChunkView(Message):
    id: int
    offset: int  # from the arena's base address
    size: int


class ArenaView(Message):
    name: str
    owner: str
    address: int  # the planned base; every client maps the arena here
    reserved: int
    committed: int
    granularity: int


class Extent(Message):
    offset: int  # from the arena's base
    size: int


# A graph pool's extents or free runs, as a request may carry them.
PoolExtents = Annotated[list[Extent], msgspec.Meta(max_length=MAX_POOL_EXTENTS)]


class RoundBudget(Message):
    """How a KV commit round split the device (bytes): ``budget`` = ``free`` -
    ``reserve`` - ``headroom``; ``minimums`` go first, the rest by weight; ``committed``
    is what the round created (0 until it commits). All 0: not measured yet."""

    free: int = 0  # measured free memory, plus the members' staged minimums
    staged: int = 0  # minimums created while the round waited for other members
    reserve: int = 0
    headroom: int = 0
    graph_pools: int = 0  # what the members' graph pools hold: already in use, not deducted
    budget: int = 0
    minimums: int = 0
    committed: int = 0


class Ack(Message):
    pass
