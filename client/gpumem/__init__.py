"""gpumem: the client library engines import to get memory from gpumemd.

    import gpumem
    with gpumem.connect(device=0, name="engine-a") as session:
        arena = session.create_arena("kv", 256 << 30)
        arena.commit(16 << 30)
        token = arena.share("engine-b")  # engine-b under this uid; the token admits it under another

Nothing here touches CUDA or opens a socket at import time.
"""

from gpumem.arena import Arena
from gpumem.errors import (
    AlreadyExists,
    ArenaAsleep,
    ArenaOutOfMemory,
    BorrowEscaped,
    BorrowOutOfMemory,
    BorrowStreamMismatch,
    DaemonStopped,
    GroupHeld,
    NotFenced,
    SessionLost,
    DaemonTimeout,
    DaemonUnavailable,
    GpuMemError,
    HostLimit,
    InvalidArgument,
    LeaseConflict,
    LeaseNotHeld,
    MappingError,
    NotFound,
    OutOfMemory,
    PermissionDenied,
    ProtocolMismatch,
    RoundFailed,
    SessionClosed,
    SocketPermissionDenied,
    StaleEpoch,
    TorchFeatureMissing,
    VaCollision,
)
from gpumem.borrow import Borrow, memory_reserved
from gpumem.elastic import ArenaUsage
from gpumem.engine import EngineMemory
from gpumem.leased_graph import LeasedGraph, leased_graphs
from gpumem.paged_kv import PagedKvCache
from gpumem.graph_pools import GraphPool
from gpumem.leases import Lease
from gpumem.views import RawView
from gpumem.kv_pool import KvBuffer, KvPool, RoundWait
from gpumem.prefix_directory import PrefixDirectory
from gpumem.retain import Adopted, RetainGroup
from gpumem.standby import Reservation
from gpumem.session import Session, connect
from gpumem.sleep import ArenaSleep
from gpumem_shared import __version__
from gpumem_shared.protocol import Extent

__all__ = [
    "Adopted",
    "AlreadyExists",
    "Arena",
    "ArenaAsleep",
    "ArenaSleep",
    "ArenaUsage",
    "ArenaOutOfMemory",
    "Borrow",
    "BorrowEscaped",
    "BorrowOutOfMemory",
    "BorrowStreamMismatch",
    "DaemonStopped",
    "SessionLost",
    "DaemonTimeout",
    "DaemonUnavailable",
    "EngineMemory",
    "Extent",
    "GpuMemError",
    "HostLimit",
    "GraphPool",
    "GroupHeld",
    "InvalidArgument",
    "KvBuffer",
    "Lease",
    "LeasedGraph",
    "LeaseConflict",
    "LeaseNotHeld",
    "KvPool",
    "MappingError",
    "NotFenced",
    "NotFound",
    "OutOfMemory",
    "PagedKvCache",
    "PermissionDenied",
    "PrefixDirectory",
    "ProtocolMismatch",
    "RoundFailed",
    "RoundWait",
    "Session",
    "SessionClosed",
    "SocketPermissionDenied",
    "StaleEpoch",
    "TorchFeatureMissing",
    "RawView",
    "Reservation",
    "RetainGroup",
    "VaCollision",
    "__version__",
    "connect",
    "leased_graphs",
    "memory_reserved",
]
