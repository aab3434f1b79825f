"""Host backend: host shared memory standing in for device memory.

Real shared memory, not a mock: a chunk is a memfd, reservations are PROT_NONE
mappings, mapping a chunk is ``mmap(MAP_SHARED | MAP_FIXED)`` of the fd received
over SCM_RIGHTS. Every protocol, crash and lease path runs on it in CI and on
machines without a GPU. The capacity is a configured figure, not the machine's RAM:
memfd pages are allocated when first touched.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import errno
import hashlib
import os
import resource
import socket
import stat
from collections.abc import Sequence
from typing import Any

from gpumem_shared.driver.base import COPY_STREAMS, Driver, DriverError, Handle, PeerAccessError, contiguous, pieces

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fallocate.restype = ctypes.c_int
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]

PROT_NONE, PROT_READ, PROT_WRITE = 0x0, 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
MAP_NORESERVE, MAP_FIXED_NOREPLACE = 0x4000, 0x100000
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
MAP_FAILED = ctypes.c_void_p(-1).value

# The same granule as the GPUs we stand in for, so sizes behave identically.
HOST_GRANULARITY = 2 << 20

_RESERVE_FLAGS = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE

# A chunk holds a descriptor for its life. The daemon's sockets need descriptors too, and
# libzmq aborts the process when it cannot accept a control-channel peer: a chunk is
# refused once fewer than this share of the open-file limit (at least _FD_RESERVE_MIN)
# would stay free.
_FD_RESERVE_SHARE = 4
_FD_RESERVE_MIN = 64


def _mmap(address: int, size: int, prot: int, flags: int, fd: int = -1) -> int:
    result = _libc.mmap(address, size, prot, flags, fd, 0)
    if result is None or result == MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(result)


def _punch(fd: int, size: int) -> None:
    """Zero a memfd chunk: its pages are dropped, and read as zero after."""
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, size) != 0:
        err = ctypes.get_errno()
        raise DriverError(f"zeroing a {size}-byte memfd chunk failed: {os.strerror(err)}")


class HostDriver(Driver):
    kind = "host"
    granularity = HOST_GRANULARITY

    def __init__(self, index: int, capacity: int = 0, peers: Sequence[int] = ()) -> None:
        """``peers`` mirrors the CUDA driver's: host memory is reachable from every
        device, so they are only checked."""
        if any(not isinstance(p, int) or p < 0 for p in peers):
            raise PeerAccessError(f"peer devices are non-negative ordinals, not {list(peers)}")
        self.index = index
        self.capacity = capacity
        self.peers = sorted(set(peers))
        # The chunks this process created or adopted, by their placement address: ``zero``
        # is given placements, and a host chunk lives in its memfd, not at its address.
        self._chunks: dict[int, int] = {}

    def device_name(self) -> str:
        return "host shared memory (memfd)"

    # Host-backend work is synchronous: nothing is in flight when a lease changes hands,
    # so events order nothing. They still get handles, so the handoff protocol runs.
    def event_create(self) -> tuple[Any, bytes]:
        handle = b"host-event:" + os.urandom(16)
        return handle, handle

    def event_open(self, handle: bytes) -> Any:
        if not handle.startswith(b"host-event:"):
            raise DriverError(f"not a host-backend event handle: {handle[:16]!r}")
        return handle

    def stream_wait(self, event: Any, stream: int) -> None:
        pass

    def native_context(self) -> int:
        return 0

    def native_event(self, event: Any) -> int:
        return 0

    def event_destroy(self, event: Any) -> None:
        pass

    # Host work is synchronous: a memops release stores its value at once, and a taker
    # polls the word itself (lease_order.py).
    def memops_problem(self) -> str | None:
        return None

    def device_uuid(self) -> str:
        # Stable per machine and index, shaped like a GPU UUID so tools treat both alike.
        try:
            with open("/etc/machine-id") as f:
                machine = f.read().strip()
        except OSError:
            machine = socket.gethostname()
        digest = hashlib.sha256(f"{machine}:{self.index}".encode()).hexdigest()
        return f"HOST-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"

    def total_bytes(self) -> int:
        return self.capacity

    def measured_free(self) -> int | None:
        return None

    def reserve(self, size: int, hint: int) -> int:
        try:
            if hint:  # 0: anywhere, as CUDA's cuMemAddressReserve takes it
                return _mmap(hint, size, PROT_NONE, _RESERVE_FLAGS | MAP_FIXED_NOREPLACE)
        except OSError as exc:
            if exc.errno != errno.EEXIST:
                raise DriverError(f"cannot reserve {size} bytes of address space: {exc.strerror}") from None
        # Taken at the hint: let the kernel place it and let the caller judge.
        try:
            return _mmap(0, size, PROT_NONE, _RESERVE_FLAGS)
        except OSError as exc:
            raise DriverError(f"cannot reserve {size} bytes of address space: {exc.strerror}") from None

    def free_reservation(self, address: int, size: int) -> None:
        if _libc.munmap(address, size) != 0:
            err = ctypes.get_errno()
            raise DriverError(f"munmap({address:#x}, {size}) failed: {os.strerror(err)}")

    def create_chunks(self, placements: list[tuple[int, int]]) -> list[Handle]:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        spare = max(_FD_RESERVE_MIN, limit // _FD_RESERVE_SHARE)
        fds: list[int] = []
        try:
            for _, size in placements:
                fd = os.memfd_create("gpumemd-chunk", os.MFD_CLOEXEC)
                fds.append(fd)
                # A new descriptor is the lowest free one: every number below it is taken.
                if fd >= limit - spare:
                    raise OSError(errno.EMFILE, f"{fd} descriptors open of the open-file limit {limit}, which must keep {spare} free")
                os.ftruncate(fd, size)
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            raise DriverError(
                f"memfd chunk creation failed: {exc.strerror} (each host chunk holds a descriptor: commit in larger "
                "chunks, or raise gpumemd's open-file limit)" if exc.errno == errno.EMFILE else f"memfd chunk creation failed: {exc.strerror}",
                out_of_memory=exc.errno in (errno.ENOMEM, errno.ENOSPC, errno.EMFILE),
            ) from None
        self._chunks.update((address, fd) for (address, _), fd in zip(placements, fds))
        return fds

    def chunk_fd(self, handle: Handle) -> int:
        return int(handle)  # a host chunk is its memfd

    def adopt_chunks(self, placements: list[tuple[int, int]], fds: list[int]) -> list[Handle]:
        for (_, size), fd in zip(placements, fds, strict=True):
            try:
                st = os.fstat(fd)
            except OSError as exc:
                raise DriverError(f"descriptor {fd} is not a chunk: {exc.strerror}") from None
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise DriverError(f"descriptor {fd} is not a {size}-byte memfd chunk (mode {st.st_mode:#o}, {st.st_size} bytes)")
        self._chunks.update((address, fd) for (address, _), fd in zip(placements, fds))
        return list(fds)

    def destroy_chunks(self, placements: list[tuple[int, int]], handles: list[Handle]) -> None:
        for (address, _), fd in zip(placements, handles):
            if self._chunks.get(address) == fd:
                del self._chunks[address]
            os.close(fd)

    def zero(self, placements: list[tuple[int, int]]) -> None:
        for address, size in placements:
            fd = self._chunks.get(address)
            if fd is None:
                raise DriverError(f"no chunk of this process at {address:#x} to zero")
            _punch(fd, size)

    def export_fds(self, chunks: list[tuple[int, int, Handle, bool]]) -> list[int]:
        # A fresh memfd reads as zero, but the promise is the driver's, not the memfd's:
        # a fresh chunk's pages are dropped (they read as zero after) before its first fd
        # leaves, whatever wrote there since it was created.
        fds: list[int] = []
        try:
            for _, size, handle, fresh in chunks:
                if fresh:
                    _punch(handle, size)
                fds.append(os.dup(handle))
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            raise DriverError(f"duplicating {len(chunks)} chunk descriptors failed: {exc.strerror}", out_of_memory=exc.errno == errno.EMFILE) from None
        except DriverError:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def read_only_fds(self, fds: list[int]) -> list[int]:
        # A descriptor opened O_RDONLY cannot back a shared writable mapping (mmap and
        # mprotect refuse PROT_WRITE: EACCES), whoever holds it. Reopening it through
        # /proc, which any holder could also do, checks the inode's mode: 0400 lets no
        # process but root open it for writing again. The descriptors the daemon and the
        # owner hold were opened read-write and stay so.
        made: list[int] = []
        try:
            for fd in fds:
                os.fchmod(fd, 0o400)
                made.append(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            for fd in made:
                os.close(fd)
            raise DriverError(f"opening a chunk read-only failed: {exc.strerror}", out_of_memory=exc.errno == errno.EMFILE) from None
        return made

    def map_fds(self, address: int, placements: list[tuple[int, int, int]], read_only: bool = False) -> None:
        done: list[tuple[int, int]] = []
        prot = PROT_READ if read_only else PROT_READ | PROT_WRITE
        try:
            for fd, offset, size in placements:
                _mmap(address + offset, size, prot, MAP_SHARED | MAP_FIXED, fd)
                done.append((offset, size))
        except OSError as exc:
            for offset, size in done:
                self.unmap(address + offset, size)
            raise DriverError(f"mapping a chunk at {address:#x} failed: {exc.strerror}") from None

    def map_aliased(self, address: int, fd: int, size: int, offsets: list[int]) -> None:
        self.map_fds(address, [(fd, offset, size) for offset in offsets])

    def unmap(self, address: int, size: int) -> None:
        # Replace the mapping with a fresh PROT_NONE one: the range stays reserved.
        try:
            _mmap(address, size, PROT_NONE, _RESERVE_FLAGS | MAP_FIXED)
        except OSError as exc:
            raise DriverError(f"unmapping {address:#x}+{size} failed: {exc.strerror}") from None

    def unmap_many(self, address: int, ranges: list[tuple[int, int]]) -> None:
        # One PROT_NONE mapping over each contiguous run replaces every mapping in it:
        # a placeholder's hundreds of slots go in one call instead of one each.
        for offset, size in contiguous(ranges):
            self.unmap(address + offset, size)

    def host_register(self, address: int, size: int) -> None:
        pass  # host memory to host memory: nothing to pin

    def host_unregister(self, address: int) -> None:
        pass

    def copy_to_host(self, copies: list[tuple[int, int, int]]) -> None:
        self._copy([(host, device, size) for device, host, size in pieces(copies)])

    def copy_to_device(self, copies: list[tuple[int, int, int]]) -> None:
        self._copy([(device, host, size) for device, host, size in pieces(copies)])

    def _copy(self, moves: list[tuple[int, int, int]]) -> None:
        """memmove (which lets go of the GIL) in a few threads: one core does not fill
        the memory bus."""
        if len(moves) <= 1:
            for dst, src, size in moves:
                ctypes.memmove(dst, src, size)
            return
        with concurrent.futures.ThreadPoolExecutor(COPY_STREAMS) as pool:
            for done in [pool.submit(ctypes.memmove, dst, src, size) for dst, src, size in moves]:
                done.result()

    def write(self, address: int, data: bytes) -> None:
        ctypes.memmove(address, data, len(data))

    def read(self, address: int, size: int) -> bytes:
        return ctypes.string_at(address, size)
