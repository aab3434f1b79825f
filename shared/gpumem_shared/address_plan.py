"""The address plan every process shares: where each device's arenas live.

Arena windows are planned in a fixed range far from heaps, libraries, the CUDA driver's
own low allocations (near 0x3_0200_0000) and torch's (near 0x7f...), split into one
4 TiB slice per device index: a process that maps arenas of several daemons (a
tensor-parallel rank reading a peer GPU's chunks) needs their windows disjoint. The
daemon of device N and every client of it reserve slice N whole, once, and place
arenas inside it: the same addresses in every process.
"""

from __future__ import annotations

VA_PLAN_BASE = 0x2000_0000_0000
VA_PLAN_SLICE = 4 << 40
VA_PLAN_SLICES = 16  # 64 TiB in all, below the top-down mmap area near 128 TiB


def plan_range(index: int) -> tuple[int, int]:
    """The address slice ``[start, end)`` of the daemon of device ``index``."""
    if not 0 <= index < VA_PLAN_SLICES:
        raise ValueError(f"device index {index}: address slices exist for 0-{VA_PLAN_SLICES - 1}")
    base = VA_PLAN_BASE + index * VA_PLAN_SLICE
    return base, base + VA_PLAN_SLICE
