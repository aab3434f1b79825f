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
    ArenaOutOfMemory,
    BorrowEscaped,
    BorrowOutOfMemory,
    BorrowStreamMismatch,
    DaemonStopped,
    SessionLost,
    DaemonTimeout,
    DaemonUnavailable,
    GpuMemError,
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
from gpumem.graph_pools import GraphPool
from gpumem.leases import Lease
from gpumem.views import RawView
from gpumem.kv_pool import KvBuffer, KvPool
from gpumem.session import Session, connect
from gpumem_shared import __version__

__all__ = [
    "AlreadyExists",
    "Arena",
    "ArenaOutOfMemory",
    "Borrow",
    "BorrowEscaped",
    "BorrowOutOfMemory",
    "BorrowStreamMismatch",
    "DaemonStopped",
    "SessionLost",
    "DaemonTimeout",
    "DaemonUnavailable",
    "GpuMemError",
    "GraphPool",
    "InvalidArgument",
    "KvBuffer",
    "Lease",
    "LeaseConflict",
    "LeaseNotHeld",
    "KvPool",
    "MappingError",
    "NotFound",
    "OutOfMemory",
    "PermissionDenied",
    "ProtocolMismatch",
    "RoundFailed",
    "Session",
    "SessionClosed",
    "SocketPermissionDenied",
    "StaleEpoch",
    "TorchFeatureMissing",
    "RawView",
    "VaCollision",
    "__version__",
    "connect",
    "memory_reserved",
]
