"""The lease table's former module name, kept for daemon/gpumemd/state.py alone while it is
being split (it may not be edited meanwhile). Delete this file once state.py imports
gpumem_shared.lease_table; its one renamed name is FLAG_SHARED (now LeaseFlag.SHARED)."""

from gpumem_shared.lease_table import KIND_NAMES, SLOTS, LeaseFlag, LeaseTable, decode, lease_epoch, word_session

FLAG_SHARED = LeaseFlag.SHARED

__all__ = ["FLAG_SHARED", "KIND_NAMES", "SLOTS", "LeaseTable", "decode", "lease_epoch", "word_session"]
