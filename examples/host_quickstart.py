#!/usr/bin/env python3
"""gpumem in five steps, with no GPU and no torch: gpumemd's host backend serves plain
shared memory through the same protocol, so everything here works the same on CUDA.

1. connect to the daemon for device 0;
2. create an arena, commit memory into it, write and read bytes;
3. share the arena with a second process, which attaches it (same memory, mapped at
   the same address there) and writes an answer the first one reads;
4. both processes declare a KV pool and size them in one commit round: each joins,
   reports capture-done, and the daemon commits rows to both at once;
5. register part of the arena as a graph pool, given as (offset, size) extents, and
   hold its replay lease (what an engine does around a CUDA graph replay).

Run it against a private daemon it starts (host backend, in a temporary directory):

    python examples/host_quickstart.py --start-daemon

or against a running one (``gpumemd --backend host`` in another terminal):

    python examples/host_quickstart.py [--runtime-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

import gpumem

MiB = 1 << 20
ROW = 4096  # bytes of one KV token row
ROUND_TIMEOUT = 60.0  # seconds a process waits for the commit round (both must report)


def kv_round(session: gpumem.Session, name: str) -> gpumem.KvPool:
    """Declare a KV pool (a K and a V buffer), join the device's round and report:
    returns once the round has committed rows to every pool that takes part."""
    kv = session.declare_kv_pool(name, [gpumem.KvBuffer("k", ROW), gpumem.KvBuffer("v", ROW)], max_tokens=1024)
    kv.join_round(expect=2)  # the round gathers both processes' pools
    tokens = kv.capture_done(min_tokens=256, timeout=ROUND_TIMEOUT)
    # Row i of buffer "k" is at byte k.offset + i * ROW of the pool's arena; view("k") gives
    # the same bytes as a DLPack / array-interface view, for numpy or torch.
    k = kv.buffers["k"]
    kv.arena.write(k.offset + (tokens - 1) * ROW, name.encode())
    assert kv.arena.read(k.offset + (tokens - 1) * ROW, len(name)) == name.encode()
    return kv


def peer(runtime_dir: str | None, arena_name: str, token: str) -> None:
    """The second process: attach the shared arena, answer in it, take part in the round."""
    with gpumem.connect(0, name="quickstart-peer", runtime_dir=runtime_dir, timeout=10.0) as session:
        arena = session.attach_arena(arena_name, token=token)
        greeting = arena.read(0, 16).rstrip(b"\0").decode()
        arena.write(4096, b"hello back")
        kv = kv_round(session, "kv-peer")
        print(json.dumps({"read": greeting, "kv_tokens": kv.tokens}), flush=True)


def main(runtime_dir: str | None) -> None:
    # 1. One session per process; it closes (releasing what it holds) on exit.
    with gpumem.connect(0, name="quickstart", runtime_dir=runtime_dir, timeout=10.0) as session:
        print(f"1. connected: session {session.session_id}, gpumemd {session.status().daemon.version}")

        # 2. An arena reserves address space; commit backs its first bytes with memory.
        arena = session.create_arena("quickstart", 256 * MiB)
        arena.commit(16 * MiB)
        arena.write(0, b"hello from owner")
        print(f"2. arena '{arena.name}': {arena.committed // MiB} MiB committed, reads {arena.read(0, 16)!r}")

        # 3. A token lets a client named quickstart-peer attach the arena.
        token = arena.share("quickstart-peer")
        other = subprocess.Popen(
            [sys.executable, __file__, "peer", arena.name, token] + (["--runtime-dir", runtime_dir] if runtime_dir else []),
            stdout=subprocess.PIPE, text=True,
        )
        # 4. This process's KV pool joins the same round as the peer's.
        kv = kv_round(session, "kv-owner")
        answer, _ = other.communicate(timeout=ROUND_TIMEOUT)
        if other.returncode != 0:
            sys.exit(f"the peer process failed (exit {other.returncode})")
        peer_said = json.loads(answer.splitlines()[-1])
        print(f"3. the peer read {peer_said['read']!r} and wrote {arena.read(4096, 10)!r} into the shared arena")
        print(f"4. one commit round sized both KV pools: kv-owner {kv.tokens} tokens, kv-peer {peer_said['kv_tokens']} tokens")

        # 5. A graph pool over the arena's first 4 MiB, and its replay lease.
        pool = arena.register_graph_pool("decode", extents=[(0, 4 * MiB)], shared=True)
        with session.replay(pool, label="quickstart replay") as lease:
            held = [f"{x.kind} by {x.holder}" for x in session.status().leases if x.pool_id == pool.id]
            print(f"5. graph pool {pool.id} '{pool.label}': lease held={lease.held} ({', '.join(held)})")
        print("quickstart: ok")


def start_daemon(directory: str) -> subprocess.Popen[bytes]:
    """A private gpumemd on the host backend; returns once it answers."""
    daemon = subprocess.Popen([sys.executable, "-m", "gpumemd", "--backend", "host", "--host-capacity", "1GiB", "--log-level", "warning", "--runtime-dir", directory])
    deadline = time.monotonic() + 30
    while True:
        try:
            with gpumem.connect(0, name="quickstart-probe", runtime_dir=directory, timeout=2.0):
                return daemon
        except gpumem.DaemonUnavailable:
            if daemon.poll() is not None or time.monotonic() > deadline:
                daemon.kill()
                sys.exit("gpumemd did not start (see its message above)")
            time.sleep(0.1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-dir", help="the daemon's runtime directory [default: $GPUMEMD_RUNTIME_DIR, then the usual places]")
    parser.add_argument("--start-daemon", action="store_true", help="start a private host-backend gpumemd for the run")
    parser.add_argument("role", nargs="*", help=argparse.SUPPRESS)  # "peer ARENA TOKEN": the second process
    args = parser.parse_args()
    if args.role:
        peer(args.runtime_dir, args.role[1], args.role[2])
    elif args.start_daemon:
        with tempfile.TemporaryDirectory(prefix="gpumem-quickstart-") as tmp:
            daemon = start_daemon(tmp)
            try:
                main(tmp)
            finally:
                daemon.terminate()
                daemon.wait(30)
    else:
        main(args.runtime_dir)
