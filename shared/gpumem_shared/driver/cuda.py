"""CUDA backend: VMM through cuda.bindings.driver.

Chunks are ``cuMemCreate`` allocations that request POSIX-fd shareable handles (the
portable path on single-node machines; FABRIC needs an IMEX channel that H200 hosts
usually lack). A client imports the fd, maps it and grants access itself: access
rights never travel with a handle. The imported handle is released at once, since
the mapping alone keeps the memory alive.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import os
from collections.abc import Sequence
from typing import Any

from gpumem_shared import _native
from gpumem_shared.driver.base import COPY_STREAMS, Driver, DriverError, DriverUnavailable, Handle, PeerAccessError, contiguous, pieces


_EVENT_DISABLE_TIMING = 0x2
_EVENT_INTERPROCESS = 0x4


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """A chunk this process holds: the driver's handle, and the POSIX fd exported from it
    at creation (or the one it was adopted from), kept as long as the handle."""

    handle: Any
    fd: int


class _IpcEventHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def _load_driver() -> Any:
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:
        raise DriverUnavailable(f"cuda-bindings is not installed ({exc.name} missing): pip install 'gpumemd[cuda]'") from None
    try:
        result = cu.cuInit(0)
    except RuntimeError:  # cuda.pathfinder's DynamicLibNotFoundError: no libcuda
        raise DriverUnavailable("no NVIDIA driver found (libcuda could not be loaded)") from None
    if result[0] != cu.CUresult.CUDA_SUCCESS:
        raise DriverUnavailable(f"cuInit failed: {_error_name(cu, result[0])}")
    return cu


def _error_name(cu: Any, err: Any) -> str:
    name = cu.cuGetErrorName(err)
    return name[1].decode() if name[0] == cu.CUresult.CUDA_SUCCESS else str(err)


def format_uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def visible_device_uuids() -> list[str]:
    """UUIDs of the CUDA devices this process sees, by its own ordinals."""
    cu = _load_driver()
    err, count = cu.cuDeviceGetCount()
    if err != cu.CUresult.CUDA_SUCCESS:
        raise DriverUnavailable(f"cuDeviceGetCount failed: {_error_name(cu, err)}")
    uuids = []
    for ordinal in range(count):
        dev = cu.cuDeviceGet(ordinal)[1]
        uuids.append(format_uuid(bytes(cu.cuDeviceGetUuid(dev)[1].bytes)))
    return uuids


class CudaDriver(Driver):
    kind = "cuda"

    def __init__(self, ordinal: int, peers: Sequence[int] = ()) -> None:
        """``peers``: other CUDA ordinals of this process whose kernels must reach what
        this driver maps (a tensor-parallel rank reading another GPU's chunks)."""
        cu = _load_driver()
        self._cu = cu
        err, count = cu.cuDeviceGetCount()
        if err != cu.CUresult.CUDA_SUCCESS or not 0 <= ordinal < count:
            raise DriverUnavailable(f"no CUDA device {ordinal} ({count if err == cu.CUresult.CUDA_SUCCESS else 0} visible)")
        self.ordinal = ordinal
        self._dev = self._ck(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        supported = self._ck(
            cu.cuDeviceGetAttribute(
                cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, self._dev
            ),
            "cuDeviceGetAttribute",
        )
        if not supported:
            raise DriverUnavailable(f"CUDA device {ordinal} cannot share memory as POSIX file descriptors")
        # The primary context is the one torch's runtime uses, so a client shares it.
        self._ctx = self._ck(cu.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        self._ck(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        self._ctx_handle = int(self._ctx)
        self._posix = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        prop.requestedHandleTypes = self._posix
        self._prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = ordinal
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        self.peers = sorted({p for p in peers if p != ordinal})
        for peer in self.peers:
            self._access.append(self._peer_access(peer, count))
        # The same devices with read access only: a read-only grant's mappings.
        self._read_access = []
        for granted in self._access:
            desc = cu.CUmemAccessDesc()
            desc.location.type, desc.location.id = granted.location.type, granted.location.id
            desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
            self._read_access.append(desc)
        self.granularity = int(
            self._ck(
                cu.cuMemGetAllocationGranularity(
                    prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
                ),
                "cuMemGetAllocationGranularity",
            )
        )

    def _peer_access(self, peer: int, count: int) -> Any:
        """An access descriptor for device ``peer``, once the hardware says it can reach
        this device's memory (NVLink or PCIe P2P)."""
        cu = self._cu
        if not 0 <= peer < count:
            raise PeerAccessError(f"peer access from CUDA device {peer}: this process sees {count} device(s) (0-{count - 1})")
        peer_dev = self._ck(cu.cuDeviceGet(peer), "cuDeviceGet")
        if not self._ck(cu.cuDeviceCanAccessPeer(peer_dev, self._dev), "cuDeviceCanAccessPeer"):
            raise PeerAccessError(
                f"CUDA device {peer} cannot access the memory of device {self.ordinal} (no peer-to-peer path between them; "
                "'nvidia-smi topo -p2p r' shows which pairs can): map it from a process on a device that can, or copy it"
            )
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = peer
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return access

    def _ck(self, result: Any, what: str) -> Any:
        err = result[0]
        if err != self._cu.CUresult.CUDA_SUCCESS:
            raise DriverError(
                f"{what} failed: {_error_name(self._cu, err)}",
                out_of_memory=err == self._cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY,
            )
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]

    # Events go through libcuda directly: these calls sit on the lease handoff path,
    # where cuda.bindings' wrappers would cost more than the driver call itself.
    def _libcuda(self) -> ctypes.CDLL:
        lib = getattr(self, "_lib", None)
        if lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuEventCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
            lib.cuIpcGetEventHandle.argtypes = [ctypes.POINTER(_IpcEventHandle), ctypes.c_void_p]
            lib.cuIpcOpenEventHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcEventHandle]
            lib.cuEventDestroy_v2.argtypes = [ctypes.c_void_p]
            lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
            lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            self._lib = lib
        return lib

    def _event_call(self, what: str, fn: Any, *args: Any) -> None:
        # Events and streams belong to this device's context, which need not be the
        # thread's current one (a process driving several GPUs).
        lib = self._lib
        current = ctypes.c_void_p()
        lib.cuCtxGetCurrent(ctypes.byref(current))
        if (current.value or 0) == self._ctx_handle:
            rc = fn(*args)
        else:
            lib.cuCtxPushCurrent_v2(self._ctx_handle)
            try:
                rc = fn(*args)
            finally:
                lib.cuCtxPopCurrent_v2(ctypes.byref(current))
        if rc != 0:
            raise DriverError(f"{what} failed: {_error_name(self._cu, self._cu.CUresult(rc))}")

    def event_create(self) -> tuple[Any, bytes]:
        lib = self._libcuda()
        event = ctypes.c_void_p()
        self._event_call("cuEventCreate", lib.cuEventCreate, ctypes.byref(event), _EVENT_INTERPROCESS | _EVENT_DISABLE_TIMING)
        handle = _IpcEventHandle()
        self._event_call("cuIpcGetEventHandle", lib.cuIpcGetEventHandle, ctypes.byref(handle), event)
        return event, bytes(handle)  # the raw 64 bytes (.reserved would stop at a NUL)

    def event_open(self, handle: bytes) -> Any:
        if len(handle) != ctypes.sizeof(_IpcEventHandle):
            raise DriverError(f"an IPC event handle has {ctypes.sizeof(_IpcEventHandle)} bytes, not {len(handle)}")
        lib = self._libcuda()
        event = ctypes.c_void_p()
        raw = _IpcEventHandle.from_buffer_copy(handle)
        self._event_call("cuIpcOpenEventHandle", lib.cuIpcOpenEventHandle, ctypes.byref(event), raw)
        return event

    # The first wait on a releaser's event, once looked up; later waits, and every
    # record, are the native lease calls' (native_context, native_event).
    def stream_wait(self, event: Any, stream: int) -> None:
        rc = _native.cuda_stream_wait(self._ctx_handle, event.value, stream)
        if rc:
            raise DriverError(f"cuStreamWaitEvent failed: {self._result_name(rc)}")

    def native_context(self) -> int:
        return self._ctx_handle

    def native_event(self, event: Any) -> int:
        return int(event.value)

    # Stream memory operations: the native lease calls use the _v2 entry points (enabled
    # by default, unlike the first ones, which needed NVreg_EnableStreamMemOPs=1).
    def memops_problem(self) -> str | None:
        cu = self._cu
        attribute = getattr(cu.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS", None)
        if attribute is None:
            return "this cuda-bindings has no CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS: upgrade cuda-bindings (12 or later)"
        err, supported = cu.cuDeviceGetAttribute(attribute, self._dev)
        if err != cu.CUresult.CUDA_SUCCESS:
            return f"cuDeviceGetAttribute(CAN_USE_64_BIT_STREAM_MEM_OPS) failed: {_error_name(cu, err)}"
        if not supported:
            return (
                f"CUDA device {self.ordinal} reports CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS = 0: its streams "
                "cannot wait on 64-bit words (check the driver version; use --lease-ordering ipc-events)"
            )
        lib = self._libcuda()
        if not hasattr(lib, "cuStreamWriteValue64_v2") or not hasattr(lib, "cuStreamWaitValue64_v2"):
            return "libcuda has no cuStreamWriteValue64_v2 / cuStreamWaitValue64_v2: the NVIDIA driver predates CUDA 11.7"
        return None

    def _result_name(self, rc: int) -> str:
        return "libcuda could not be loaded" if rc < 0 else _error_name(self._cu, self._cu.CUresult(rc))

    def event_destroy(self, event: Any) -> None:
        self._event_call("cuEventDestroy", self._libcuda().cuEventDestroy_v2, event)

    def _current(self) -> None:
        # Driver calls need the context current on the calling thread; allocator
        # callbacks and client threads may arrive without it.
        self._ck(self._cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def device_name(self) -> str:
        raw: bytes = self._ck(self._cu.cuDeviceGetName(256, self._dev), "cuDeviceGetName")
        return raw.split(b"\0", 1)[0].decode()

    def device_uuid(self) -> str:
        return format_uuid(bytes(self._ck(self._cu.cuDeviceGetUuid(self._dev), "cuDeviceGetUuid").bytes))

    def total_bytes(self) -> int:
        return int(self._ck(self._cu.cuDeviceTotalMem(self._dev), "cuDeviceTotalMem"))

    def measured_free(self) -> int | None:
        self._current()
        free, _total = self._ck(self._cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free)

    def reserve(self, size: int, hint: int) -> int:
        self._current()
        return int(self._ck(self._cu.cuMemAddressReserve(size, self.granularity, hint, 0), "cuMemAddressReserve"))

    def free_reservation(self, address: int, size: int) -> None:
        self._current()
        self._ck(self._cu.cuMemAddressFree(address, size), "cuMemAddressFree")

    def _set_access(self, address: int, ranges: list[tuple[int, int]], read_only: bool = False) -> None:
        # One cuMemSetAccess per contiguous run: it may span several mappings.
        access = self._read_access if read_only else self._access
        for start, size in contiguous(ranges):
            self._ck(self._cu.cuMemSetAccess(address + start, size, access, len(access)), "cuMemSetAccess")

    def create_chunks(self, placements: list[tuple[int, int]]) -> list[Handle]:
        cu = self._cu
        self._current()
        handles: list[Handle] = []
        created: list[_Chunk] = []
        mapped: list[tuple[int, int]] = []
        try:
            for address, size in placements:
                handle = self._ck(cu.cuMemCreate(size, self._prop, 0), "cuMemCreate")
                handles.append(handle)
                # Exported once, now: an importer cannot export again, so this fd is what
                # a restarted daemon finds the chunk by (and what every handout dups).
                created.append(_Chunk(handle, self._export(handle)))
                self._ck(cu.cuMemMap(address, size, 0, handle, 0), "cuMemMap")
                mapped.append((address, size))
            self._set_access(0, mapped)
        except DriverError:
            self._undo_maps(mapped, handles)
            for chunk in created:
                os.close(chunk.fd)
            raise
        return list(created)

    def chunk_fd(self, handle: Handle) -> int:
        return int(handle.fd)

    def adopt_chunks(self, placements: list[tuple[int, int]], fds: list[int]) -> list[Handle]:
        cu = self._cu
        self._current()
        handles: list[Any] = []
        mapped: list[tuple[int, int]] = []
        try:
            for (address, size), fd in zip(placements, fds, strict=True):
                handles.append(self._ck(cu.cuMemImportFromShareableHandle(fd, self._posix), f"cuMemImportFromShareableHandle (descriptor {fd})"))
                self._ck(cu.cuMemMap(address, size, 0, handles[-1], 0), f"cuMemMap (descriptor {fd}, {size} bytes)")
                mapped.append((address, size))
            self._set_access(0, mapped)
        except DriverError:
            self._undo_maps(mapped, handles)
            raise
        return [_Chunk(handle, fd) for handle, fd in zip(handles, fds)]

    def _undo_maps(self, mapped: list[tuple[int, int]], handles: list[Any]) -> None:
        """What a failed create or adopt made so far: its mappings, then its handles."""
        for address, size in mapped:
            self._cu.cuMemUnmap(address, size)
        for handle in handles:
            self._cu.cuMemRelease(handle)

    def destroy_chunks(self, placements: list[tuple[int, int]], handles: list[Handle]) -> None:
        self._current()
        for (address, size), chunk in zip(placements, handles):
            try:
                self._ck(self._cu.cuMemUnmap(address, size), "cuMemUnmap")
                self._ck(self._cu.cuMemRelease(chunk.handle), "cuMemRelease")
            finally:
                os.close(chunk.fd)

    def zero(self, placements: list[tuple[int, int]]) -> None:
        self._current()
        for start, size in contiguous(placements):
            self._ck(self._cu.cuMemsetD32Async(start, 0, size // 4, 0), "cuMemsetD32Async")
        self._ck(self._cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def export_fds(self, chunks: list[tuple[int, int, Handle, bool]]) -> list[int]:
        cu = self._cu
        self._current()
        fds: list[int] = []
        try:
            # Fresh allocations read back as zero in our samples, but the driver does not
            # promise it: zero them. The memsets run while the CPU dups the fds, and the
            # fds leave this function only after the sync.
            for start, size in contiguous([(address, size) for address, size, _, fresh in chunks if fresh]):
                self._ck(cu.cuMemsetD32Async(start, 0, size // 4, 0), "cuMemsetD32Async")
            for _, _, chunk, _ in chunks:
                fds.append(os.dup(chunk.fd))  # Python's dup is close-on-exec
            self._ck(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            raise DriverError(f"duplicating {len(chunks)} chunk descriptors failed: {exc.strerror}", out_of_memory=exc.errno == errno.EMFILE) from None
        except DriverError:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def _export(self, handle: Handle) -> int:
        fd = int(self._ck(self._cu.cuMemExportToShareableHandle(handle, self._posix, 0), "cuMemExportToShareableHandle"))
        # The driver does not promise O_CLOEXEC; a spawned helper must not pin chunks.
        fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)
        return fd

    def read_only_fds(self, fds: list[int]) -> list[int]:
        # A CUDA chunk's fd is a handle to the whole allocation: whoever imports it may map
        # it and set any access it likes. Read-only is the client's mapping (read access
        # only, cuMemSetAccess), which keeps a correct standby from writing by mistake and
        # a wild kernel of it from corrupting the weights; it does not stop a hostile
        # process of a grant's uid. docs/architecture.md, "Read-only grants".
        made: list[int] = []
        try:
            for fd in fds:
                made.append(os.dup(fd))
        except OSError as exc:
            for fd in made:
                os.close(fd)
            raise DriverError(f"duplicating a chunk descriptor failed: {exc.strerror}") from None
        return made

    def map_fds(self, address: int, placements: list[tuple[int, int, int]], read_only: bool = False) -> None:
        cu = self._cu
        self._current()
        mapped: list[tuple[int, int]] = []
        try:
            for fd, offset, size in placements:
                handle = self._ck(cu.cuMemImportFromShareableHandle(fd, self._posix), "cuMemImportFromShareableHandle")
                try:
                    self._ck(cu.cuMemMap(address + offset, size, 0, handle, 0), "cuMemMap")
                finally:
                    cu.cuMemRelease(handle)  # the mapping keeps the memory alive
                mapped.append((offset, size))
            self._set_access(address, mapped, read_only)
        except DriverError:
            for offset, size in mapped:
                cu.cuMemUnmap(address + offset, size)
            raise

    def map_aliased(self, address: int, fd: int, size: int, offsets: list[int]) -> None:
        cu = self._cu
        self._current()
        handle = self._ck(cu.cuMemImportFromShareableHandle(fd, self._posix), "cuMemImportFromShareableHandle")
        mapped: list[tuple[int, int]] = []
        try:
            for offset in offsets:
                self._ck(cu.cuMemMap(address + offset, size, 0, handle, 0), "cuMemMap")
                mapped.append((offset, size))
            self._set_access(address, mapped)
        except DriverError:
            for offset, _ in mapped:
                cu.cuMemUnmap(address + offset, size)
            raise
        finally:
            cu.cuMemRelease(handle)  # the mappings keep the memory alive

    def unmap(self, address: int, size: int) -> None:
        self._current()
        # cuMemUnmap does not wait for in-flight work on the range.
        self._ck(self._cu.cuCtxSynchronize(), "cuCtxSynchronize")
        self._ck(self._cu.cuMemUnmap(address, size), "cuMemUnmap")

    def unmap_many(self, address: int, ranges: list[tuple[int, int]]) -> None:
        self._current()
        self._ck(self._cu.cuCtxSynchronize(), "cuCtxSynchronize")
        for offset, size in ranges:
            self._ck(self._cu.cuMemUnmap(address + offset, size), "cuMemUnmap")

    def host_register(self, address: int, size: int) -> None:
        self._current()
        self._ck(self._cu.cuMemHostRegister(address, size, 0), "cuMemHostRegister")

    def host_unregister(self, address: int) -> None:
        self._current()
        self._ck(self._cu.cuMemHostUnregister(address), "cuMemHostUnregister")

    def _copy_streams(self) -> list[Any]:
        streams: list[Any] | None = getattr(self, "_streams", None)
        if streams is None:
            flag = int(self._cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
            streams = [self._ck(self._cu.cuStreamCreate(flag), "cuStreamCreate") for _ in range(COPY_STREAMS)]
            self._streams = streams
        return streams

    def copy_to_host(self, copies: list[tuple[int, int, int]]) -> None:
        self._current()
        self._ck(self._cu.cuCtxSynchronize(), "cuCtxSynchronize")  # the engine's kernels write what is copied
        streams = self._copy_streams()
        for i, (device, host, size) in enumerate(pieces(copies)):
            self._ck(self._cu.cuMemcpyDtoHAsync(host, device, size, streams[i % len(streams)]), "cuMemcpyDtoHAsync")
        for stream in streams:
            self._ck(self._cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def copy_to_device(self, copies: list[tuple[int, int, int]]) -> None:
        self._current()
        streams = self._copy_streams()
        for i, (device, host, size) in enumerate(pieces(copies)):
            self._ck(self._cu.cuMemcpyHtoDAsync(device, host, size, streams[i % len(streams)]), "cuMemcpyHtoDAsync")
        for stream in streams:
            self._ck(self._cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def write(self, address: int, data: bytes) -> None:
        self._current()
        self._ck(self._cu.cuMemcpyHtoD(address, data, len(data)), "cuMemcpyHtoD")
        # From pageable memory the copy may return once the bytes are staged, before the
        # DMA lands (CUDA documents it): a process reading right after could see the old
        # bytes, as a test on the H200 once did.
        self._ck(self._cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def read(self, address: int, size: int) -> bytes:
        self._current()
        buf = (ctypes.c_uint8 * size)()
        self._ck(self._cu.cuMemcpyDtoH(buf, address, size), "cuMemcpyDtoH")
        return bytes(buf)
