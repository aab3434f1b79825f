"""When a process that ended can no longer write memory it mapped: the fence a retain
group's adoption waits for (retained.py), and the proof a restarted daemon takes a dead
session's name over on (state.py).

On the host backend a process writes its chunks with its own threads only, so it is
fenced once it is gone: no such process, a zombie whose every thread has exited (its
address space and descriptors are gone with the last one) or a pid reused by a later
process. On CUDA the process's kernels
may run on after its threads: the GPU stops writing when the driver tears the process's
context down, which happens when the process's descriptors of the device files are
released (at exit, after the address space and before it becomes a zombie). So CUDA
adds the driver's own view: the device's compute processes as NVML lists them must not
name the pid. bench/fence_probe.py measures when writes stop against both signals, and
docs/architecture.md ("Fencing") records what it showed.

A process is not the only writer its death leaves: on the host backend a child it forked
keeps its mappings (fds closed or not), and ``processes_mapping`` finds any process that
still maps a memfd of the daemon's, by its maps. On CUDA a forked child cannot use its
parent's context (CUDA does not survive fork), so the parent's fence covers it.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable

log = logging.getLogger("gpumemd.fencing")

# "" when the process that said HELLO as pid at a unix time can no longer write what it
# mapped; otherwise why it may.
Fence = Callable[[int, float], str]

# A process that started more than this after a session's HELLO is not the one that said
# it (its pid was reused): /proc gives the start in clock ticks after a boot time in
# whole seconds.
_START_SLACK = 2.0


def process_gone(pid: int, since: float) -> bool:
    """Whether the process that said HELLO as ``pid`` at ``since`` (unix time) is provably
    gone: no such process, a zombie (its descriptors are closed), or one that started
    after that HELLO. Anything unreadable proves nothing, and pid 0 (a client outside the
    daemon's pid namespace) has nothing to read. So does a /proc of another pid namespace
    than the daemon's (one inherited by ``unshare --pid`` without a fresh proc mount, or a
    container given the host's): the pid would name another process there."""
    if pid <= 0:
        return False
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return False
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    except (FileNotFoundError, ProcessLookupError):
        return True
    except (OSError, StopIteration, ValueError):
        return False
    fields = stat[stat.rindex(b")") + 2 :].split()  # the command name may hold spaces and parentheses
    if fields[0] in (b"Z", b"X"):
        # A zombie leader is not a dead process while its other threads still exit: they
        # share its descriptors (and, on CUDA, its context) until the last one is gone.
        # bench/fence_probe.py --backend host saw the leader a zombie with threads left
        # milliseconds before the process's sockets closed.
        return _threads(pid) <= 1
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK") > since + _START_SLACK


def _threads(pid: int) -> int:
    """The threads /proc counts for ``pid`` (0 once it is reaped)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(b"Threads:"))
    except (FileNotFoundError, ProcessLookupError):
        return 0
    except (OSError, StopIteration, ValueError):
        return 2  # unreadable proves nothing


def processes_mapping(files: set[tuple[int, int]], skip: int) -> list[int]:
    """The processes (pids in the daemon's /proc) but ``skip`` whose address space maps
    any of ``files`` ((st_dev, st_ino) of the host backend's memfds): a forked child of a
    dead holder keeps its parent's mappings with every descriptor closed, and nothing
    but its maps says so. A process whose maps the daemon may not read (another uid's,
    where the daemon is not root) is not seen; neither is one in another pid namespace."""
    if not files:
        return []
    devices = {dev for dev, _ in files}
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == skip:
            continue
        try:
            with open(f"/proc/{entry.name}/maps", "rb") as f:
                text = f.read()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if b"memfd:" not in text:
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or not fields[5].startswith(b"/memfd:"):
                continue
            major, _, minor = fields[3].partition(b":")
            dev = os.makedev(int(major, 16), int(minor, 16))
            if dev in devices and (dev, int(fields[4])) in files:
                found.append(int(entry.name))
                break
    return found


def host_fence(pid: int, since: float) -> str:
    return "" if process_gone(pid, since) else f"pid {pid} still runs"


class _ProcessInfo(ctypes.Structure):
    # nvmlProcessInfo_t (v2, the layout the _v3 call fills)
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


_NVML_SUCCESS = 0
_NVML_ERROR_INSUFFICIENT_SIZE = 7


class NvmlProcesses:
    """The compute processes NVML lists on one device (libnvidia-ml, which ships with the
    driver, through ctypes: no Python package needed)."""

    def __init__(self, uuid: str) -> None:
        self._lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self._lib.nvmlInit_v2(), "nvmlInit_v2")
        self._device = ctypes.c_void_p()
        self._check(self._lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(self._device)), f"nvmlDeviceGetHandleByUUID({uuid})")

    def _check(self, rc: int, what: str) -> None:
        if rc != _NVML_SUCCESS:
            raise OSError(f"{what} failed: NVML error {rc}")

    def pids(self) -> set[int]:
        size = 64
        while True:
            count = ctypes.c_uint(size)
            infos = (_ProcessInfo * size)()
            rc = self._lib.nvmlDeviceGetComputeRunningProcesses_v3(self._device, ctypes.byref(count), infos)
            if rc == _NVML_ERROR_INSUFFICIENT_SIZE and size < 1 << 16:
                size = max(count.value, size * 2)
                continue
            self._check(rc, "nvmlDeviceGetComputeRunningProcesses_v3")
            return {infos[i].pid for i in range(count.value)}


def cuda_fence(uuid: str) -> Fence:
    """The host fence, and NVML must no longer list the pid on the device. Without NVML
    (not loadable) the host fence alone, said once in the log: bench/fence_probe.py says
    what that leaves open."""
    try:
        nvml: NvmlProcesses | None = NvmlProcesses(uuid)
    except OSError as exc:
        log.warning("NVML is not available (%s): a retain group's fence is the dead process's exit alone", exc)
        nvml = None

    def fence(pid: int, since: float) -> str:
        if not process_gone(pid, since):
            return f"pid {pid} still runs"
        if nvml is None:
            return ""
        try:
            listed = pid in nvml.pids()
        except OSError as exc:
            return f"NVML cannot say whether pid {pid} still has a context on the device ({exc})"
        return f"pid {pid} has exited, but NVML still lists its context on the device (its GPU work may still run)" if listed else ""

    return fence


def fence_for(kind: str, uuid: str) -> Fence:
    return cuda_fence(uuid) if kind == "cuda" else host_fence
