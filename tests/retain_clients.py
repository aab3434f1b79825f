"""tests/clients.py's shell with the retained-memory commands, for the integration and
GPU tests of retain groups (tests/integration/test_retain.py).

    python tests/retain_clients.py shell NAME [DEVICE] [--as UID:GID]

Commands, besides every one of tests/clients.py:
  group GROUP                  (the secret)               retain GROUP NAME     unretain GROUP NAME
  adopt GROUP SECRET WAIT [noconfirm] [reserved]   (JSON: arenas {name: address}, kv {name: [address, tokens]}, previous;
                               reserved: into the reservation of GROUP)
  reserve GROUP SECRET         (JSON {name: address} of the windows reserved)    unreserve GROUP
  park GROUP                   (the reservation's placeholder unmapped, its windows kept)
  rview KEY GROUP NAME OFFSET N  (a tensor over the reserved window, built now: NumPy, or torch via DLPack with a
                               CUDA graph of a copy out of it captured now)
  vread KEY                    (the distinct byte values read through KEY's tensor, or on CUDA its graph replayed)
  vfill KEY BYTE               (written through KEY's tensor)
  confirm GROUP                cut  (shut the fd channel down, the process lives on: its session ends)
  forkwrite ARENA BYTE         (host backend: a forked child, every descriptor closed, writes BYTE over the arena's
                               first page until killed; its pid)
  dircreate NAME BLOCKS        dirpublish NAME BLOCK HASH     dirinvalidate NAME BLOCK
  dirtear NAME BLOCK HASH      (a publish cut short: the first half of the entry written)
  dirscan NAME BLOCKS          (JSON: blocks {hash: block}, empty, corrupt, beyond)
  diropen NAME                 (an adopted arena opened as a directory)
  roshare ARENA CLIENT|-       (a read-only grant; its token)
  access ARENA                 (how this process may touch the arena's first byte: "rw" or "r"; the
                                host's /proc/self/maps, CUDA's cuMemGetAccess)
  rofds ARENA [TOKEN]          (ARENA_ATTACH on the control channel, its descriptors taken off the fd channel
                                here and tried: JSON access mode, and whether a writable shared mapping and a
                                read-write reopen through /proc succeed; closed after)
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import mmap
import os
import select
import socket
import struct
import sys
import time

import clients
import gpumem
from gpumem_shared import protocol as p
from gpumem.prefix_directory import ENTRY_BYTES, HEADER_BYTES, PrefixDirectory

GROUPS: dict[str, gpumem.RetainGroup] = {}
RESERVED: dict[str, gpumem.Reservation] = {}
VIEWS: dict[str, tuple[object, object, object]] = {}  # key: the tensor, a graph and its output (CUDA)
ADOPTED: dict[str, gpumem.Adopted] = {}
DIRECTORIES: dict[str, PrefixDirectory] = {}


def run(session: gpumem.Session, arenas: dict[str, gpumem.Arena], cmd: str, args: list[str]) -> object:
    if cmd == "group":
        GROUPS[args[0]] = session.retain_group(args[0])
        return GROUPS[args[0]].secret
    if cmd in ("retain", "unretain"):
        group = GROUPS[args[0]]
        target = DIRECTORIES[args[1]].arena if args[1] in DIRECTORIES else arenas[args[1]]
        (group.retain if cmd == "retain" else group.unretain)(target)
        return None
    if cmd == "adopt":
        reservation = RESERVED.get(args[0]) if "reserved" in args[3:] else None
        adopted = session.adopt(args[0], args[1], wait=float(args[2]), confirm="noconfirm" not in args[3:], reservation=reservation)
        ADOPTED[args[0]] = adopted
        arenas.update(adopted.arenas)
        for name, pool in adopted.kv_pools.items():
            clients.POOLS[name] = pool
            arenas[name] = pool.arena
        return json.dumps({
            "arenas": {n: a.address for n, a in adopted.arenas.items()},
            "kv": {n: [pool.arena.address, pool.tokens] for n, pool in adopted.kv_pools.items()},
            "previous": adopted.previous,
            "waited_for": adopted.waited_for,
        })
    if cmd == "reserve":
        RESERVED[args[0]] = session.reserve_retained(args[0], args[1])
        return json.dumps({n: o.arena.address for n, o in RESERVED[args[0]].objects.items()})
    if cmd == "park":
        RESERVED[args[0]].park()
        return None
    if cmd == "unreserve":
        RESERVED.pop(args[0]).close()
        return None
    if cmd == "rview":
        view = RESERVED[args[1]].view(args[2], int(args[3]), int(args[4]))
        VIEWS[args[0]] = _tensor(session, view)
        return None
    if cmd == "vread":
        return json.dumps(_read(session, VIEWS[args[0]]))
    if cmd == "vfill":
        tensor = VIEWS[args[0]][0]
        tensor[:] = int(args[1])  # type: ignore[index]
        return None
    if cmd == "confirm":
        ADOPTED[args[0]].confirm()
        return None
    if cmd == "cut":
        sock = session.channel._sockets.fd_sock
        assert sock is not None
        sock.shutdown(socket.SHUT_RDWR)
        return None
    if cmd == "dircreate":
        DIRECTORIES[args[0]] = session.create_prefix_directory(args[0], blocks=int(args[1]))
        return None
    if cmd == "diropen":
        DIRECTORIES[args[0]] = PrefixDirectory.open(arenas[args[0]])
        return None
    if cmd == "dirpublish":
        DIRECTORIES[args[0]].publish(int(args[1]), int(args[2]))
        return None
    if cmd == "dirinvalidate":
        DIRECTORIES[args[0]].invalidate(int(args[1]))
        return None
    if cmd == "dirtear":
        # What a death in the middle of a publish leaves: sequence and hash written, the
        # block id and checksum not yet.
        d = DIRECTORIES[args[0]]
        d.arena.write(HEADER_BYTES + int(args[1]) * ENTRY_BYTES, struct.pack("<QQ", 99, int(args[2])))
        return None
    if cmd == "dirscan":
        scan = DIRECTORIES[args[0]].scan(int(args[1]))
        return json.dumps({"blocks": {str(h): b for h, b in scan.blocks.items()}, "empty": scan.empty, "corrupt": scan.corrupt, "beyond": scan.beyond})
    if cmd == "forkwrite":
        return _fork_writer(arenas[args[0]].address, int(args[1]))
    if cmd == "roshare":
        return arenas[args[0]].share(None if args[1] == "-" else args[1], read_only=True)
    if cmd == "access":
        return _access(session, arenas[args[0]].address)
    if cmd == "rofds":
        return json.dumps(_try_fds(session, args[0], args[1] if len(args) > 1 else ""))
    return clients.run(session, arenas, cmd, args)


def _fork_writer(address: int, value: int) -> int:
    """A child that keeps its parent's mappings and nothing else (B2 of issue 37): it
    closes every descriptor, fd channel included, and writes on."""
    pid = os.fork()
    if pid:
        return pid
    os.closerange(0, 65536)
    while True:
        ctypes.memset(address, value, 4096)
        time.sleep(0.001)


def _tensor(session: gpumem.Session, view: gpumem.RawView) -> tuple[object, object, object]:
    """A tensor over ``view``; on CUDA also a graph, captured now, copying it out."""
    if session.backend != "cuda":
        import numpy

        return numpy.asarray(view), None, None
    import torch

    src = torch.from_dlpack(view)
    dst = torch.empty_like(src)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dst.copy_(src)  # warm-up outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            dst.copy_(src)
    torch.cuda.synchronize()
    return src, graph, dst


def _read(session: gpumem.Session, held: tuple[object, object, object]) -> list[int]:
    tensor, graph, out = held
    if graph is None:
        import numpy

        return [int(x) for x in numpy.unique(tensor)]  # type: ignore[call-overload]
    import torch

    graph.replay()  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    return [int(x) for x in torch.unique(out).tolist()]  # type: ignore[call-overload]


def _access(session: gpumem.Session, address: int) -> str:
    if session.backend == "cuda":
        from cuda.bindings import driver as cu

        where = cu.CUmemLocation()
        where.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        where.id = session.device_ordinal or 0
        err, flags = cu.cuMemGetAccess(where, address)
        assert int(err) == 0, err
        return {cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE: "rw", cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ: "r"}.get(flags, str(flags))
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return perms[:2].replace("-", "")
    return "unmapped"


def _try_fds(session: gpumem.Session, arena: str, token: str) -> dict[str, object]:
    reply = session.channel._control.call(p.AttachArena(name=arena, token=token), session.timeout)
    sock = session.channel._sockets.fd_sock
    assert sock is not None
    got: list[int] = []
    while len(got) < len(reply.chunks) and select.select([sock], [], [], 5.0)[0]:
        _, fds, _, _ = socket.recv_fds(sock, 1 << 16, p.MAX_FDS_PER_MESSAGE)
        got += fds
    out: dict[str, object] = {"read_only": reply.read_only, "fds": len(got), "modes": [], "write_map": [], "reopen_rw": []}
    for fd in got:
        out["modes"].append("rdonly" if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY else "rdwr")  # type: ignore[attr-defined]
        try:
            mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE).close()
            out["write_map"].append(True)  # type: ignore[attr-defined]
        except OSError:
            out["write_map"].append(False)  # type: ignore[attr-defined]
        try:
            os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDWR))
            out["reopen_rw"].append(True)  # type: ignore[attr-defined]
        except OSError:
            out["reopen_rw"].append(False)  # type: ignore[attr-defined]
        os.close(fd)
    return out


def main() -> int:
    return clients.shell(run, with_detail=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
