"""What the daemon is configured with, and the address plan every process shares.

The bottom of the daemon's import graph: no other gpumemd module is imported here.
"""

from __future__ import annotations

import dataclasses

from gpumem_shared import protocol as p

MiB = 1 << 20
GiB = 1 << 30

# Arena windows are planned in a fixed range far from heaps, libraries, the CUDA
# driver's own low allocations (near 0x3_0200_0000) and torch's (near 0x7f...), split
# into one 4 TiB slice per device index: a process that maps arenas of several daemons
# (a tensor-parallel rank reading a peer GPU's chunks) needs their windows disjoint.
VA_PLAN_BASE = 0x2000_0000_0000
VA_PLAN_SLICE = 4 << 40
VA_PLAN_SLICES = 16  # 64 TiB in all, below the top-down mmap area near 128 TiB


def plan_range(index: int) -> tuple[int, int]:
    """The address range the daemon of device ``index`` plans arena windows in."""
    if not 0 <= index < VA_PLAN_SLICES:
        raise ValueError(f"device index {index}: address slices exist for 0-{VA_PLAN_SLICES - 1}")
    base = VA_PLAN_BASE + index * VA_PLAN_SLICE
    return base, base + VA_PLAN_SLICE


@dataclasses.dataclass
class StateConfig:
    index: int
    runtime_dir: str = ""
    bulk_chunk: int = 512 * MiB  # bulk commits come in chunks this large
    # KV prefixes: one chunk per this much of each buffer. Larger makes rounds faster
    # (fewer creates, exports and maps) and shrinks coarser (whole chunks only).
    kv_chunk: int = GiB
    reserve_bytes: int = 0  # never committed: the headroom other users of the device need
    va_base: int = VA_PLAN_BASE
    va_limit: int = VA_PLAN_BASE + VA_PLAN_SLICE
    max_reserve: int = VA_PLAN_SLICE
    round_timeout: float = 300.0  # seconds from a round's first join to its deadline
    round_policy: p.RoundPolicy = p.RoundPolicy.PARTIAL  # what a round's passed deadline does
