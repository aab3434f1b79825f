"""A scriptable gpumem client process for integration and GPU tests.

    python tests/clients.py shell NAME [DEVICE] [--as UID:GID] [--tenant-token-file PATH]

connects as client NAME and then runs one command per stdin line, answering each
with one stdout line: ``OK [result]`` or ``ERR <ExceptionClass> <message>``. With
``--as``, the process drops to that uid and gid (no supplementary groups) once its
modules are loaded and before it connects: the daemon sees another user. With
``--tenant-token-file``, it presents the tenant token in that file at HELLO.

Commands:
  create ARENA RESERVE         commit ARENA NBYTES        decommit ARENA TO
  share ARENA CLIENT|- [uid=N] [gid=N]  (the grant's token)  unshare ARENA TOKEN
  attach ARENA [TOKEN]         sync ARENA
  release ARENA                write ARENA OFFSET HEX     read ARENA OFFSET N
  fill ARENA OFFSET N BYTE     check ARENA OFFSET N BYTE  (whole-range pattern, device side)
  placeholder ARENA OFFSET NBYTES SLOT                     backed ARENA (JSON)
  rawwrite ARENA OFFSET HEX    rawread ARENA OFFSET N     (through the driver: placeholder too)
  viewfill ARENA OFFSET N BYTE (through arena.view() and NumPy or DLPack)
  kvdeclare POOL NBUF ROW MAXTOK   kvplaceholder POOL     join POOL
  capture POOL HEADROOM MIN MAX WEIGHT   (blocks until the round commits; JSON result)
  grow POOL TOKENS             shrink POOL TOKENS         shrinkreq POOL   kvcheck POOL
  kvgrow POOL TOKENS (JSON tokens, unanswered)            demand POOL IN_USE
  answershrink POOL TIMEOUT    (waits up to TIMEOUT s for a KV_SHRINK notice, answers it; JSON tokens kept, null if none came)
  sleep ARENA keep|drop        wake ARENA [WAIT]          freehost ARENA
  sleepstage ARENA             (the host buffer taken and the copy made, the chunks not handed back yet: a sleep cut short)
  sleepprep ARENA              (its host buffer made and registered ahead, ArenaSleep.prepare; JSON as sleep)
  address ARENA                free                       ping
  notices                      status                     close
  exit
  kvdeclarex POOL MAXTOK RESERVE JSON   (buffers as [[name, row_bytes, align], ...]; JSON layout)
  capturex POOL HEADROOM GRAPHPOOL MIN MAX WEIGHT TIMEOUT   (as capture, every figure; JSON result)
  kvinfo POOL (JSON)           kvrelease POOL             joinx POOL EXPECT
  errinfo COMMAND ...          (runs COMMAND; a GpuMemError comes back as OK JSON with its detail)
  gpregister ARENA LABEL OFFSET SIZE [shared]   (a synthetic graph pool in committed memory; JSON id/epoch)
  open POOL                    (open another client's shared pool; its arena attached; JSON id/epoch)
  lease KIND POOL WAIT LABEL   (KIND capture|replay|borrow; the pool as registered or opened here,
                                opened on first use, then kept: the view may go stale)
  unlease POOL                 gpview POOL (refresh this client's view of an opened pool; JSON id/epoch)
  scribble POOL FIELD HEX      (a buggy client: writes FIELD, one of word handoff escaped epoch flags,
                                of the pool's lease slot, through this process's mapping of it)
  peek POOL (JSON: the slot's word, waiters, handoff, escaped)
  segments (JSON: the graph pools whose lease segments this process maps, and holds descriptors of)
  leaseloop POOL SECONDS SHMFILE INDEX   (acquire/release in a loop, checking exclusion in SHMFILE; JSON)
  rawattach ARENA [TOKEN]      (ARENA_ATTACH on the control channel alone: the fd channel is left unread)
  fdqueue                      (take what waits on the fd channel, bypassing the library; JSON messages/fds)
  probe ADDRESS SIZE           (JSON: open fds, "fd -> target", and whether anything is mapped at [ADDRESS, +SIZE)
                                in this process; after a ping, so the control channel's connection is open)
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import time
import traceback
from collections.abc import Callable

import gpumem
from gpumem_shared import protocol as p
from gpumem.sleep import ArenaSleep
from gpumem_shared.lease_table import SEGMENT_NAME, LeaseKind


def main() -> int:
    return shell(run)


Run = Callable[[gpumem.Session, dict[str, gpumem.Arena], str, list[str]], object]


def shell(run: Run, *, with_detail: bool = False) -> int:
    """``shell NAME [DEVICE] [--as UID:GID] [--tenant-token-file F]``: connect, then run
    each stdin line through ``run`` and answer ``OK [result]`` or ``ERR Type [detail] message``
    (``with_detail``: the error's detail as JSON before its message)."""
    _, scenario, name, *rest = sys.argv
    assert scenario == "shell", scenario
    if "--as" in rest:
        at = rest.index("--as")
        uid, gid = (int(x) for x in rest[at + 1].split(":"))
        del rest[at : at + 2]
        become(uid, gid)
    token_file = None
    if "--tenant-token-file" in rest:
        at = rest.index("--tenant-token-file")
        token_file = rest[at + 1]
        del rest[at : at + 2]
    device: int | str = int(rest[0]) if rest and rest[0].isdigit() else (rest[0] if rest else 0)
    try:
        session = gpumem.connect(device, name=name, tenant_token_file=token_file)
    except gpumem.GpuMemError as exc:
        print(f"ERR {type(exc).__name__} {exc}", flush=True)
        return 0
    print(f"CONNECTED {session.session_id} {session.backend}", flush=True)
    arenas: dict[str, gpumem.Arena] = {}
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        try:
            result = run(session, arenas, words[0], words[1:])
        except SystemExit:
            return 0
        except gpumem.GpuMemError as exc:
            detail = f"{json.dumps(exc.detail)} " if with_detail else ""
            print(f"ERR {type(exc).__name__} {detail}{exc}", flush=True)
            continue
        except Exception as exc:  # a bug in the library: show it to the test
            traceback.print_exc()
            print(f"ERR {type(exc).__name__} {exc}", flush=True)
            continue
        print(f"OK {result}" if result is not None else "OK", flush=True)
    return 0


def become(uid: int, gid: int) -> None:
    """Drop to ``uid``/``gid`` for good. What the session loads later is loaded first:
    the checkout need not be readable by that user."""
    import importlib

    importlib.import_module("gpumem_shared.driver.host")
    try:
        importlib.import_module("gpumem_shared.driver.cuda")
    except ImportError:
        pass
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


POOLS: dict[str, gpumem.KvPool] = {}
SLEEPERS: dict[str, ArenaSleep] = {}
LEASES: dict[int, object] = {}


def run(session: gpumem.Session, arenas: dict[str, gpumem.Arena], cmd: str, args: list[str]) -> object:
    if cmd == "kvdeclare":
        name, nbuf, row, max_tokens = args[0], int(args[1]), int(args[2]), int(args[3])
        buffers = [gpumem.KvBuffer(f"b{i}", row) for i in range(nbuf)]
        POOLS[name] = session.declare_kv_pool(name, buffers, max_tokens=max_tokens)
        arenas[name] = POOLS[name].arena
        return POOLS[name].max_tokens
    if cmd == "kvplaceholder":
        POOLS[args[0]].placeholder()
        return POOLS[args[0]].arena.placeholder_bytes
    if cmd == "join":
        view = POOLS[args[0]].join_round()
        return f"{view.round_id} {view.state}"
    if cmd == "capture":
        pool = POOLS[args[0]]
        tokens = pool.capture_done(
            headroom_bytes=int(args[1]), min_tokens=int(args[2]), max_tokens=int(args[3]), weight=float(args[4])
        )
        return json.dumps({"tokens": tokens, "budget": p.to_wire(pool.budget), "committed": pool.arena.committed_ranges()})
    if cmd == "grow":
        return POOLS[args[0]].grow(int(args[1]))
    if cmd == "shrink":
        return POOLS[args[0]].shrink(int(args[1]))
    if cmd == "kvgrow":
        pool = POOLS[args[0]]
        pool.grow(int(args[1]))
        return json.dumps({"tokens": pool.tokens, "unanswered": pool.unanswered})
    if cmd == "demand":
        POOLS[args[0]].report_demand(int(args[1]))
        return ""
    if cmd == "answershrink":
        deadline = time.monotonic() + float(args[1])
        kept = POOLS[args[0]].answer_shrinks()
        while kept is None and time.monotonic() < deadline:
            time.sleep(0.01)  # notices arrive on the fd channel; polled, within the deadline
            kept = POOLS[args[0]].answer_shrinks()
        return json.dumps(kept)
    if cmd == "shrinkreq":
        return json.dumps(POOLS[args[0]].shrink_requests())
    if cmd in ("kvsleep", "kvwake"):  # POOL keep|drop, POOL [WAIT]
        pool = POOLS[args[0]]
        kv_sleeper = SLEEPERS.setdefault(args[0], ArenaSleep(pool.arena, pool))
        if cmd == "kvsleep":
            kv_sleeper.sleep(keep=args[1] == "keep")
        else:
            kv_sleeper.wake(**({"wait": float(args[1])} if len(args) > 1 else {}))
        return json.dumps({"tokens": pool.tokens})
    if cmd == "kvcheck":
        # every buffer's committed prefix is mapped and writable, and bytes stay put
        pool = POOLS[args[0]]
        for b in pool.buffers.values():
            last = b.offset + pool.tokens * b.row_bytes - 8
            pool.arena.write(b.offset, b"\x5a" * 8)
            pool.arena.write(last, b"\xa5" * 8)
            if pool.arena.read(b.offset, 8) != b"\x5a" * 8 or pool.arena.read(last, 8) != b"\xa5" * 8:
                return f"MISMATCH in {b.name}"
        return "MATCH"
    if cmd == "create":
        arenas[args[0]] = session.create_arena(args[0], int(args[1]))
        return arenas[args[0]].address
    if cmd == "attach":
        arenas[args[0]] = session.attach_arena(args[0], token=args[1] if len(args) > 1 else None)
        return arenas[args[0]].address
    if cmd == "rawattach":
        reply = session.channel._control.call(p.AttachArena(name=args[0], token=args[1] if len(args) > 1 else ""), session.timeout)
        return json.dumps({"chunks": len(reply.chunks), "fd_batches": reply.fd_batches})
    if cmd == "fdqueue":
        return json.dumps(_drain_fd_channel(session))
    if cmd == "probe":
        # A reply first: ZeroMQ opens the DEALER's connection on its own thread, a moment
        # after connect, and a count taken before it would grow by itself.
        session.ping()
        return json.dumps({"fds": _open_fds(), "mapped": _mapped(session, int(args[0]), int(args[1]))})
    if cmd == "unshare":
        arenas[args[0]].unshare(args[1])
        return None
    if cmd == "commit":
        arenas[args[0]].commit(int(args[1]))
        return arenas[args[0]].committed
    if cmd == "decommit":
        return arenas[args[0]].decommit(int(args[1]))
    if cmd == "share":
        ids = {k: int(v) for k, v in (a.split("=") for a in args[2:])}
        return arenas[args[0]].share(None if args[1] == "-" else args[1], **ids)
    if cmd == "sync":
        arenas[args[0]].sync()
        return arenas[args[0]].mapped_bytes
    if cmd == "release":
        arenas.pop(args[0]).release()
        return None
    if cmd == "write":
        arenas[args[0]].write(int(args[1]), bytes.fromhex(args[2]))
        return None
    if cmd == "read":
        return arenas[args[0]].read(int(args[1]), int(args[2])).hex()
    if cmd == "fill":
        arena, offset, n, byte = arenas[args[0]], int(args[1]), int(args[2]), int(args[3])
        block = bytes([byte]) * min(n, 64 << 20)
        for at in range(offset, offset + n, len(block)):
            arena.write(at, block[: min(len(block), offset + n - at)])
        return None
    if cmd == "check":
        arena, offset, n, byte = arenas[args[0]], int(args[1]), int(args[2]), int(args[3])
        step = 64 << 20
        for at in range(offset, offset + n, step):
            data = arena.read(at, min(step, offset + n - at))
            if data.count(byte) != len(data):
                bad = next(i for i, b in enumerate(data) if b != byte)
                return f"MISMATCH at {at + bad}: {data[bad]} != {byte}"
        return "MATCH"
    if cmd == "placeholder":
        arenas[args[0]].placeholder(int(args[1]), int(args[2]), int(args[3]))
        return arenas[args[0]].placeholder_bytes
    if cmd == "backed":
        a = arenas[args[0]]
        return json.dumps({"backed": a.backed_ranges(), "committed": a.committed_ranges(), "placeholder": a.placeholder_bytes})
    if cmd == "rawwrite":
        a = arenas[args[0]]
        session.driver.write(a.address + int(args[1]), bytes.fromhex(args[2]))
        return None
    if cmd == "rawread":
        a = arenas[args[0]]
        return session.driver.read(a.address + int(args[1]), int(args[2])).hex()
    if cmd == "viewfill":
        view = arenas[args[0]].view(int(args[1]), int(args[2]))
        if session.backend == "cuda":
            import torch

            torch.from_dlpack(view).fill_(int(args[3]))
            torch.cuda.synchronize()
        else:
            import numpy

            numpy.asarray(view)[:] = int(args[3])
        return None
    if cmd in ("sleep", "wake", "freehost", "sleepstage", "sleepprep"):
        sleeper = SLEEPERS.setdefault(args[0], ArenaSleep(arenas[args[0]]))
        if cmd == "sleep":
            sleeper.sleep(keep=args[1] == "keep")
        elif cmd == "wake":
            sleeper.wake(**({"wait": float(args[1])} if len(args) > 1 else {}))
        elif cmd == "freehost":
            sleeper.free_host()
        elif cmd == "sleepprep":
            sleeper.prepare()
        else:
            arena = arenas[args[0]]
            sleeper.prepare(arena.committed)
            assert sleeper.host is not None
            session.driver.copy_to_host([(arena.address, sleeper.host.address, arena.committed)])
        return json.dumps({"committed": arenas[args[0]].committed, "host": sleeper.host.size if sleeper.host else 0})
    if cmd == "address":
        return arenas[args[0]].address
    if cmd == "free":
        return session.driver.measured_free()
    if cmd == "ping":
        session.ping()
        return None
    if cmd == "notices":
        return json.dumps([p.to_wire(n) for n in session.notices()])
    if cmd == "status":
        return json.dumps(p.to_wire(session.status()))
    if cmd == "close":
        session.close()
        return None
    if cmd == "exit":
        raise SystemExit(0)
    if cmd == "kvdeclarex":
        name, max_tokens, reserve = args[0], int(args[1]), int(args[2])
        buffers = [gpumem.KvBuffer(b[0], int(b[1]), int(b[2])) for b in json.loads(" ".join(args[3:]))]
        POOLS[name] = session.declare_kv_pool(name, buffers, max_tokens=max_tokens, reserve_bytes=reserve)
        arenas[name] = POOLS[name].arena
        return json.dumps(_kv_info(POOLS[name]))
    if cmd == "capturex":
        pool = POOLS[args[0]]
        tokens = pool.capture_done(
            headroom_bytes=int(args[1]),
            graph_pool_bytes=int(args[2]),
            min_tokens=int(args[3]),
            max_tokens=int(args[4]),
            weight=float(args[5]),
            timeout=float(args[6]) if len(args) > 6 else None,
        )
        return json.dumps({"tokens": tokens, **_kv_info(pool)})
    if cmd == "kvinfo":
        return json.dumps(_kv_info(POOLS[args[0]]))
    if cmd == "joinx":
        view = POOLS[args[0]].join_round(expect=int(args[1]))
        return f"{view.round_id} {view.state}"
    if cmd == "kvrelease":
        POOLS.pop(args[0]).release()
        arenas.pop(args[0], None)
        return None
    if cmd == "errinfo":
        try:
            result = run(session, arenas, args[0], args[1:])
        except gpumem.GpuMemError as exc:
            return json.dumps({"error": type(exc).__name__, "message": exc.message, "detail": exc.detail})
        return json.dumps({"result": result})
    if cmd == "gpregister":
        extents = [p.Extent(offset=int(args[2]), size=int(args[3]))]
        pool = arenas[args[0]].register_graph_pool(args[1], extents=extents, free_runs=[], shared=args[4:] == ["shared"])
        GRAPH_POOLS[pool.id] = pool
        return json.dumps({"id": pool.id, "epoch": pool.epoch})
    if cmd == "open":
        pool = _graph_pool(session, int(args[0]))
        return json.dumps({"id": pool.id, "epoch": pool.epoch})
    if cmd == "lease":
        kind, pool_id, wait, label = args[0], int(args[1]), float(args[2]), args[3]
        pool = _graph_pool(session, pool_id)
        if kind == "borrow":  # the borrow lease alone: no borrow pool over the runs
            LEASES[pool_id] = gpumem.Lease.acquire(session.leasing, pool, LeaseKind.BORROW, label, wait)
        else:
            LEASES[pool_id] = getattr(session, kind)(pool, wait=wait, label=label)
        return kind
    if cmd == "gpview":
        pool = _graph_pool(session, int(args[0]))
        pool.refresh()
        return json.dumps({"id": pool.id, "epoch": pool.epoch})
    if cmd == "unlease":
        LEASES.pop(int(args[0])).release()  # type: ignore[attr-defined]
        return None
    if cmd == "scribble":
        setattr(_graph_pool(session, int(args[0])).segment._slot, args[1], int(args[2], 16))
        return None
    if cmd == "scribble+lease":  # POOL HEXWORD KIND WAIT LABEL: no daemon tick can fall between the two
        _graph_pool(session, int(args[0])).segment._slot.word = int(args[1], 16)
        return run(session, arenas, "lease", [args[2], args[0], *args[3:]])
    if cmd == "peek":
        slot = _graph_pool(session, int(args[0])).segment._slot
        return json.dumps({"word": int(slot.word), "waiters": int(slot.waiters), "handoff": int(slot.handoff), "escaped": int(slot.escaped)})
    if cmd == "segments":
        return json.dumps({"mapped": _segments_mapped(), "fds": _segments_held()})
    if cmd == "leaseloop":
        return json.dumps(_lease_loop(session, int(args[0]), float(args[1]), args[2], int(args[3])))
    raise ValueError(f"unknown command {cmd!r}")


GRAPH_POOLS: dict[int, gpumem.GraphPool] = {}
def _drain_fd_channel(session: gpumem.Session) -> dict[str, object]:
    """Every message waiting on the session's fd channel, read at the socket (not through
    the library, which closes stray descriptors itself): how many, and how many fds
    came with them (closed here)."""
    sock = session.channel._sockets.fd_sock
    assert sock is not None
    messages = fds = 0
    kinds = []
    while select.select([sock], [], [], 0)[0]:
        payload, got, _, _ = socket.recv_fds(sock, 1 << 16, p.MAX_FDS_PER_MESSAGE)
        messages += 1
        fds += len(got)
        kinds.append(type(p.decode_event(payload)).__name__)
        for fd in got:
            os.close(fd)
    return {"messages": messages, "fds": fds, "kinds": kinds}


def _open_fds() -> list[str]:
    """This process's descriptors as "fd -> what", so a difference names what came."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except FileNotFoundError:  # listdir's own descriptor, closed by now
            continue
    return sorted(fds)


def _mapped(session: gpumem.Session, address: int, size: int) -> bool:
    """Whether this process maps memory in [address, address + size): readable host
    mappings from /proc/self/maps; on CUDA, what the driver says of the first and the last byte
    (whether each is backed by an allocation mapped in this process)."""
    if session.backend == "cuda":
        from cuda.bindings import driver as cu

        mapped = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MAPPED
        for at in (address, address + size - 1):
            err, value = cu.cuPointerGetAttribute(mapped, at)
            if err == cu.CUresult.CUDA_SUCCESS and value:
                return True
        return False
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            # The address slice stays reserved (PROT_NONE, "---p") while the session lives:
            # only a readable mapping holds bytes.
            if start < address + size and address < end and perms.startswith("r"):
                return True
    return False


VIEWS: dict[int, p.GraphPoolStatus] = {}


def _graph_pool(session: gpumem.Session, pool_id: int) -> gpumem.GraphPool:
    """This client's graph pool: registered here, or opened the first time it is asked
    for, and kept afterwards, as a real client keeps it (its view may go stale)."""
    if pool_id not in GRAPH_POOLS:
        GRAPH_POOLS[pool_id] = session.open_graph_pool(pool_id)
    return GRAPH_POOLS[pool_id]


def _segment_pool(name: str) -> int | None:
    """The graph pool a lease segment's memfd name (as /proc shows it) belongs to."""
    prefix = f"/memfd:{SEGMENT_NAME}"
    if not name.startswith(prefix):
        return None
    return int(name[len(prefix) :].split()[0])


def _segments_mapped() -> list[int]:
    with open("/proc/self/maps") as maps:
        fields = [line.split(maxsplit=5) for line in maps]
    found = (_segment_pool(f[5].strip()) for f in fields if len(f) == 6)
    return sorted(pool for pool in found if pool is not None)


def _segments_held() -> list[int]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(_segment_pool(os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            pass  # the directory's own descriptor, gone once listed
    return sorted(pool for pool in found if pool is not None)


def _lease_loop(session: gpumem.Session, pool_id: int, seconds: float, shm_file: str, index: int) -> dict[str, object]:
    """Take the pool's lease (every kind in turn) and give it back until ``seconds`` pass.
    SHMFILE holds two int64 shared by every looping process: [0] how many are inside
    (must be exactly 1 while held), [1] critical sections entered in all (a plain
    read-modify-write: only exclusion keeps it exact)."""
    import mmap
    import os
    import random
    import struct
    import time

    pool = _graph_pool(session, pool_id)
    fd = os.open(shm_file, os.O_RDWR)
    shared = mmap.mmap(fd, 4096)
    os.close(fd)
    rng = random.Random(index)
    kinds = [lambda: session.capture(pool, wait=5.0, label=f"loop{index}"),
             lambda: session.replay(pool, wait=5.0, label=f"loop{index}"),
             lambda: gpumem.Lease.acquire(session.leasing, pool, LeaseKind.BORROW, f"loop{index}", 5.0)]
    count = violations = conflicts = contended = 0
    longest = 0.0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        asked = time.monotonic()
        if pool.segment.peek():
            contended += 1  # someone holds it as this one asks: the test exercises the wait
        try:
            lease = kinds[count % 3]()
        except gpumem.LeaseConflict:
            conflicts += 1
            continue
        longest = max(longest, time.monotonic() - asked)
        inside = struct.unpack_from("q", shared, 0)[0] + 1
        struct.pack_into("q", shared, 0, inside)
        if inside != 1:
            violations += 1
        struct.pack_into("q", shared, 8, struct.unpack_from("q", shared, 8)[0] + 1)
        for _ in range(rng.randrange(0, 20)):  # hold it a little while
            if struct.unpack_from("q", shared, 0)[0] != 1:
                violations += 1
                break
        struct.pack_into("q", shared, 0, struct.unpack_from("q", shared, 0)[0] - 1)
        lease.release()
        count += 1
        if rng.random() < 0.3:
            time.sleep(0)  # sometimes let the others in
    shared.close()
    return {"count": count, "violations": violations, "conflicts": conflicts, "contended": contended, "longest_wait": longest}


def _kv_info(pool: gpumem.KvPool) -> dict[str, object]:
    return {
        "tokens": pool.tokens,
        "max_tokens": pool.max_tokens,
        "bytes_per_token": pool.bytes_per_token,
        "round_id": pool.round_id,
        "budget": p.to_wire(pool.budget),
        "buffers": {b.name: [b.offset, b.row_bytes, b.region_bytes] for b in pool.buffers.values()},
        "committed": pool.arena.committed_ranges(),
        "reserved": pool.arena.reserved,
    }


if __name__ == "__main__":
    sys.exit(main())
