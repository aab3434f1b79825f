"""Borrowing a graph pool's free runs, scenario by scenario, each in its own process, on
whichever backend the daemon runs.

    python tests/borrow_scenarios.py SCENARIO [ARGS...]

CUDA: a graph captured into an arena's torch pool, whose 64 MiB transient leaves a free
run; borrowed memory is torch tensors made inside the borrow scope. Host: a synthetic
pool whose "graph" is a function that writes through its runs (as a replay overwrites
its intermediates) and derives its output from them; borrowed memory is raw views.
Either way a replay that overlapped a borrow would show in the graph's output or in
the borrower's bytes. A scenario prints "PASS <name>" and exits 0, or fails with a
traceback. The daemon is found through $GPUMEMD_RUNTIME_DIR.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from typing import Any

import gpumem
from gpumem_shared import lease_table
from gpumem_shared.lease_table import LeaseKind
from gpumem_shared import protocol as p

MiB = 1 << 20
GiB = 1 << 30
OWNER = "graph-owner"
BORROWER = "draft-worker"
ARENA = "graphs"
LABEL = "decode"


class HostWorkload:
    """A 64 MiB pool: input [0, 1 MiB), output [1, 2 MiB), runs of 8 and 32 MiB that a
    replay fills with its step number before computing the output from them."""

    backend = "host"

    def __init__(self, session: gpumem.Session, *, shared: bool) -> None:
        self.session = session
        self.arena = session.create_arena(ARENA, GiB)
        self.arena.commit(64 * MiB)
        self.pool = self.arena.register_graph_pool(
            LABEL,
            extents=[p.Extent(offset=0, size=64 * MiB)],
            free_runs=[p.Extent(offset=8 * MiB, size=8 * MiB), p.Extent(offset=24 * MiB, size=32 * MiB)],
            shared=shared,
        )
        self._runs = list(self.pool.free_runs)
        self.step = 0
        ctypes.memset(self.arena.address, 3, MiB)

    def replay(self) -> None:
        self.step += 1
        for run in self.pool.free_runs:
            ctypes.memset(self.arena.address + run.offset, self.step & 0xFF, run.size)
        intermediate = ctypes.string_at(self.arena.address + self.pool.free_runs[-1].offset + 4096, 1)[0]
        ctypes.memset(self.arena.address + MiB, (3 + intermediate) & 0xFF, MiB)

    def output(self) -> Any:
        return ctypes.string_at(self.arena.address + MiB, MiB)

    def check(self, output: Any) -> None:
        want = bytes([(3 + self.step) & 0xFF]) * MiB
        assert output == want, f"replay {self.step}: the graph's output is wrong (a borrower overlapped it?)"

    def change_runs(self) -> None:
        """The owner's pool now has other runs (an eager allocation took the old ones)."""
        reply = self.session.call(
            p.UpdateGraphPool(
                pool_id=self.pool.id, extents=[p.Extent(offset=0, size=64 * MiB)], free_runs=[p.Extent(offset=40 * MiB, size=16 * MiB)]
            )
        )
        self.pool._set(reply.pool)

    def recaptured(self) -> None:
        """After a capture lease: report the (unchanged) runs again."""
        reply = self.session.call(
            p.UpdateGraphPool(pool_id=self.pool.id, extents=list(self.pool.extents), free_runs=list(self._runs), recaptured=True)
        )
        self.pool._set(reply.pool)

    def sync(self) -> None:
        pass


class CudaWorkload:
    """y = relu(x @ w1) @ w2 with a 64 MiB intermediate, captured into the arena's pool."""

    backend = "cuda"

    def __init__(self, session: gpumem.Session, *, shared: bool) -> None:
        import torch

        self.torch = torch
        self.session = session
        self.arena = session.create_arena(ARENA, 8 * GiB)
        self.arena.commit(GiB)
        gen = torch.Generator(device="cuda").manual_seed(0)
        with self.arena.allocating():
            self.x = torch.randn(1024, 1024, device="cuda", generator=gen) / 32
            self.w1 = torch.randn(1024, 16384, device="cuda", generator=gen) / 32
            self.w2 = torch.randn(16384, 1024, device="cuda", generator=gen) / 128
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with self.arena.allocating():
                torch.relu(self.x @ self.w1) @ self.w2  # warm-up: cuBLAS picks its kernels
            with torch.cuda.graph(self.graph, pool=self.arena.torch_pool().graph_pool, stream=stream):
                self.y = torch.relu(self.x @ self.w1) @ self.w2
        torch.cuda.synchronize()
        self.expected = self.y.clone()
        self.pool = self.arena.register_graph_pool(LABEL, shared=shared)
        assert self.pool.free_runs and self.pool.free_runs[0].size >= 64 * MiB, self.pool

    def replay(self) -> None:
        self.graph.replay()

    def output(self) -> Any:
        return self.y.clone()  # queued on the stream: no wait here

    def check(self, output: Any) -> None:
        assert self.torch.equal(output, self.expected), "the graph's output is wrong (a borrower overlapped it?)"

    def recaptured(self) -> None:
        self.pool.refresh(recaptured=True)

    def change_runs(self) -> None:
        with self.arena.allocating():
            self.eager = self.torch.empty(8 * MiB, dtype=self.torch.uint8, device="cuda")  # takes part of a free run
        self.pool.refresh()

    def sync(self) -> None:
        self.torch.cuda.synchronize()


def workload(session: gpumem.Session, *, shared: bool = False) -> HostWorkload | CudaWorkload:
    return CudaWorkload(session, shared=shared) if session.backend == "cuda" else HostWorkload(session, shared=shared)


# --------------------------------------------------------------------------- borrowed memory


def fill(session: gpumem.Session, borrow: gpumem.Borrow, nbytes: int, value: int) -> Any:
    """Inside a borrow: ``nbytes`` of borrowed memory, set to ``value``."""
    if session.backend == "cuda":
        import torch

        return torch.full((nbytes,), value, dtype=torch.uint8, device="cuda")
    view = borrow.allocate(nbytes)
    ctypes.memset(view.address, value, nbytes)
    return view


def holds(block: Any, value: int) -> Any:
    """Whether the block still holds ``value`` everywhere (CUDA: a queued device bool)."""
    if hasattr(block, "data_ptr"):
        return (block == value).all()
    return ctypes.string_at(block.address, block.nbytes) == bytes([value]) * block.nbytes


def address(block: Any) -> int:
    return int(block.data_ptr()) if hasattr(block, "data_ptr") else int(block.address)


def in_runs(pool: gpumem.GraphPool, start: int, nbytes: int) -> bool:
    base = pool.arena.address
    return any(base + r.offset <= start and start + nbytes <= base + r.offset + r.size for r in pool.free_runs)


def raises(kind: type[BaseException], fn: Any, *parts: str) -> BaseException:
    try:
        fn()
    except kind as exc:
        for part in parts:
            assert part in str(exc), f"{part!r} missing from: {exc}"
        return exc
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {kind.__name__}")


def device_memory() -> tuple[int, int]:
    """(device bytes in use, torch's reserved bytes outside borrow pools) on CUDA."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free, torch.cuda.memory_reserved()


def borrowed_segments(session: gpumem.Session) -> int:
    import torch

    return sum(
        seg["total_size"]
        for bp in session.borrow_pools.values()
        if bp.torch_pool is not None
        for seg in torch.cuda.memory_snapshot(bp.torch_pool.id)
    )


# --------------------------------------------------------------------------- one process


def in_runs_and_no_new_memory() -> None:
    with gpumem.connect(0, name=OWNER) as s:
        w = workload(s)
        used = reserved = 0
        for step in range(4):
            # Step 0 warms up: cuBLAS workspaces (the first borrow on a stream), the
            # owner's output check's own temporaries. The steps after it are the steady state.
            if step == 1 and s.backend == "cuda":
                w.sync()
                used, _ = device_memory()
                reserved = gpumem.memory_reserved()
            with s.borrow(w.pool, user="probs") as b:
                block = fill(s, b, 16 * MiB, 7 + step)
                assert in_runs(w.pool, address(block), 16 * MiB), (hex(address(block)), w.pool.free_runs)
                assert bool(holds(block, 7 + step))
                del block
            with s.replay(w.pool):
                w.replay()
            w.check(w.output())
        bp = s.borrow_pools[w.pool.id]
        if s.backend == "cuda":
            w.sync()
            used_after, reserved_after = device_memory()
            aliases = borrowed_segments(s)
            print(f"device used {used} -> {used_after}; torch reserved outside borrow pools {reserved} -> {reserved_after - aliases}; "
                  f"borrow-pool segments (aliases of the runs, counted by torch too) {aliases}")
            assert used_after == used, f"borrowing took device memory: {used} -> {used_after}"
            assert reserved_after - aliases == reserved == gpumem.memory_reserved(), "borrowing grew torch's own pools"
            assert bp.builds == 1, f"torch caches the borrow pool's blocks: no rebuild expected, saw {bp.builds}"
        else:
            assert bp.builds == 4, f"raw blocks freed between scopes: each later scope rebuilds, saw {bp.builds}"
    print("PASS in_runs_and_no_new_memory")


def oom_and_can_fit() -> None:
    with gpumem.connect(0, name=OWNER) as s:
        w = workload(s)
        with s.borrow(w.pool, user="first"):  # warms cuBLAS outside the runs
            pass
        if s.backend == "cuda":

            w.sync()
            outside = gpumem.memory_reserved()
        largest = w.pool.free_runs[0].size
        for nbytes in [MiB, MiB + 1, largest - 4096, largest, largest + 1, 2 * largest]:
            predicted = None
            try:
                with s.borrow(w.pool, user=f"fit-{nbytes}") as b:
                    predicted = b.can_fit(nbytes)
                    block = fill(s, b, nbytes, 1)
                    del block
                got = True
            except gpumem.BorrowOutOfMemory as exc:
                got = False
                assert f"borrow scope 'fit-{nbytes}'" in str(exc) and "never falls back" in str(exc), exc
            assert predicted == got, f"can_fit({nbytes}) said {predicted}, the allocation {'succeeded' if got else 'failed'}"
            assert w.pool.segment.peek() == 0, "a failed scope still holds its lease"
        if s.backend == "cuda":
            assert gpumem.memory_reserved() <= outside, "a refused request fell back to torch's pools"
    print("PASS oom_and_can_fit")


def escape_is_caught() -> None:
    with gpumem.connect(0, name=OWNER) as s:
        w = workload(s, shared=True)
        w.arena.share(BORROWER)
        kept: list[Any] = []

        def escaping() -> None:
            with s.borrow(w.pool, user="EAGLE probability borrow") as b:
                kept.append(fill(s, b, 4 * MiB, 9))

        raises(gpumem.BorrowEscaped, escaping, "'EAGLE probability borrow'", "still alive")
        assert w.pool.segment.peek() == 0, "an escape must still give the lease back"
        assert w.pool.segment.escaped() == lease_table.word_session(s.session_id)
        assert [g.escaped_by for g in s.status().graph_pools] == [f"client '{OWNER}'"], "gpumemctl shows who blocks replays"
        shown = subprocess.run([sys.executable, "-m", "gpumem.ctl", "extents"], capture_output=True, text=True, timeout=30)
        assert f"replay and capture refused: client '{OWNER}' holds borrowed tensors" in shown.stdout, shown
        raises(gpumem.BorrowEscaped, lambda: s.replay(w.pool), "'EAGLE probability borrow'", "replay")
        raises(gpumem.BorrowEscaped, lambda: s.capture(w.pool), "capture")
        peer(["escaped_peer_refused", str(w.pool.id)])
        with s.borrow(w.pool, user="another step"):  # borrowing again is fine: torch knows the live block
            pass
        release = raises(gpumem.InvalidArgument, w.arena.release, f"arena '{ARENA}'")  # the tensor's memory would vanish
        if s.backend == "host":
            assert "borrowed from graph pool" in str(release), release
        kept.clear()
        with s.replay(w.pool):  # the owner notices the tensor is gone and clears the mark
            w.replay()
        w.check(w.output())
        assert w.pool.segment.escaped() == 0 and s.status().graph_pools[0].escaped_by == ""
        peer(["peer_replays", str(w.pool.id)])
    print("PASS escape_is_caught")


def escaped_peer_refused(pool_id: str) -> None:
    with gpumem.connect(0, name=BORROWER) as s:
        s.attach_arena(ARENA)
        pool = s.open_graph_pool(int(pool_id))
        exc = raises(gpumem.BorrowEscaped, lambda: s.replay(pool), f"client '{OWNER}'", "past their borrow scope")
        assert exc.detail["holder"] == OWNER, exc.detail
    print("PASS escaped_peer_refused")


def peer_replays(pool_id: str) -> None:
    with gpumem.connect(0, name=BORROWER) as s:
        s.attach_arena(ARENA)
        pool = s.open_graph_pool(int(pool_id))
        with s.replay(pool, label="peer"):
            pass
    print("PASS peer_replays")


def rebuild_rules() -> None:
    with gpumem.connect(0, name=OWNER) as s:
        w = workload(s)

        def borrow_once(nbytes: int = MiB) -> None:
            with s.borrow(w.pool, user="step") as b:
                block = fill(s, b, nbytes, 5)
                assert in_runs(w.pool, address(block), nbytes)
                del block

        borrow_once(16 * MiB)
        bp = s.borrow_pools[w.pool.id]
        assert bp.builds == 1
        if s.backend == "cuda":
            borrow_once(16 * MiB)
            assert bp.builds == 1, "a steady step must reuse the pool"
        before = bp.builds
        # Freed bytes: the host's raw blocks come back at once. torch never gives a live
        # MemPool's segments back (empty_cache and its out-of-memory path release only
        # pools nobody holds), so on CUDA the rule stays idle: a failed request, and
        # empty_cache, leave the pool as it is.
        try:
            with s.borrow(w.pool, user="too big") as b:
                fill(s, b, 4 * bp.capacity, 1)
        except gpumem.BorrowOutOfMemory:
            pass
        else:
            raise AssertionError("a request larger than every run was served")
        if s.backend == "cuda":
            import torch

            torch.cuda.empty_cache()
            assert bp.slot.stats().freed_bytes == 0
        borrow_once()
        assert bp.builds == (before + 1 if s.backend == "host" else before), (before, bp.builds)
        before = bp.builds
        with s.borrow(w.pool, user="big step") as b:  # the cursor passes half the runs
            blocks = []
            while bp.slot.stats().cursor_bytes <= bp.capacity // 2:
                blocks.append(fill(s, b, 4 * MiB, 6))
            del blocks
        borrow_once()
        # host: the frees alone rebuild at each entry; CUDA: the cursor does, once
        assert bp.builds == (before + 2 if s.backend == "host" else before + 1), (before, bp.builds)
        # new runs: a new epoch, and a rebuild on them
        epoch, before = w.pool.epoch, bp.builds
        w.change_runs()
        assert w.pool.epoch == epoch + 1
        borrow_once()
        assert bp.builds == before + 1 and bp.runs_key is not None and bp.runs_key[0] == w.pool.epoch
        # capture retires the borrow pool and empties the registered runs under a new
        # epoch until the owner reports them: a borrower in between finds no run at all
        epoch = w.pool.epoch
        with s.capture(w.pool):
            assert bp.capacity == 0 and bp.runs_key is None
            assert w.pool.epoch == epoch + 1 and w.pool.free_runs == [] and s.status().graph_pools[0].free_runs == []
        try:
            borrow_once()
        except gpumem.BorrowOutOfMemory:
            pass
        else:
            raise AssertionError("a borrow between a capture and its report found runs")
        w.recaptured()
        assert w.pool.epoch == epoch + 2 and w.pool.free_runs
        borrow_once()
        assert bp.builds == before + 3
    print("PASS rebuild_rules")


def stream_binding() -> None:
    with gpumem.connect(0, name=OWNER) as s:
        w = workload(s)
        if s.backend == "cuda":
            import torch

            with s.borrow(w.pool, user="main stream"):
                pass
            other = torch.cuda.Stream()
            with torch.cuda.stream(other):
                raises(gpumem.BorrowStreamMismatch, lambda: s.borrow(w.pool, user="side stream"), "stream", "first borrow")
            assert w.pool.segment.peek() == 0, "a refused borrow took the lease"

            def allocate_on_other_stream() -> None:
                with s.borrow(w.pool, user="mixed"):
                    with torch.cuda.stream(other):
                        torch.empty(MiB, dtype=torch.uint8, device="cuda")

            raises(gpumem.BorrowStreamMismatch, allocate_on_other_stream, "another stream", "'mixed'")
            assert w.pool.segment.peek() == 0
        else:
            with s.borrow(w.pool, user="stream 0", stream=0):
                pass
            raises(gpumem.BorrowStreamMismatch, lambda: s.borrow(w.pool, user="stream 7", stream=7), "stream 0x7")
            assert w.pool.segment.peek() == 0
    print("PASS stream_binding")


def cublas_warmed_before_first_borrow() -> None:
    import torch

    with gpumem.connect(0, name=OWNER) as s:
        w = workload(s)
        with s.borrow(w.pool, user="first gemm on a new stream"):
            a = torch.randn(256, 256, device="cuda")
            c = torch.nn.functional.linear(a, a, a[0]) @ a  # cuBLAS and cuBLASLt workspaces, were they cold
            total = float(c.sum())
            del a, c
        assert total == total, "the GEMM produced NaN"
    print("PASS cublas_warmed_before_first_borrow")


# --------------------------------------------------------------------------- two processes


def peer(args: list[str], timeout: float = 600.0) -> str:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0 and f"PASS {args[0]}" in out.stdout, f"{args[0]} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


class Peer:
    """A scenario in another process, driven line by line."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def expect(self, line: str) -> None:
        assert self.proc.stdout is not None
        got = self.proc.stdout.readline().strip()
        assert got == line, f"peer said {got!r}, expected {line!r} (exit {self.proc.poll()})"

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def finish(self, name: str, timeout: float = 600.0) -> None:
        out, _ = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0 and f"PASS {name}" in out, f"{name} failed ({self.proc.returncode}): {out}"


def _slow_fill(session: gpumem.Session, region: Any, value: int) -> None:
    """Queue a fill of ``region`` behind about 200 ms of GPU work (CUDA), so that only
    the lease's event ordering keeps the next holder from seeing it unfinished."""
    if session.backend == "cuda":
        import torch

        torch.cuda._sleep(400_000_000)
        region.fill_(value)
    else:
        ctypes.memset(region.address, value, region.nbytes)


def _region(session: gpumem.Session, pool: gpumem.GraphPool, nbytes: int) -> Any:
    """The first ``nbytes`` of the pool's largest free run, outside any allocator."""
    offset = pool.free_runs[0].offset
    if session.backend == "cuda":
        import torch

        return pool.arena.tensor(offset, (nbytes,), torch.uint8)
    return pool.arena.view(offset, nbytes)


def _reads(session: gpumem.Session, region: Any, value: int) -> bool:
    if session.backend == "cuda":
        return bool((region == value).all())
    return ctypes.string_at(region.address, region.nbytes) == bytes([value]) * region.nbytes


# Each round: the owner's slow write handed to the peer's borrow, the peer's handed back to
# the owner's replay. In the first, each side publishes its event and looks the other's up
# (its first wait is the driver's call); in the second, both are known, and the native
# lease calls alone record and wait.
HANDOFF_ROUNDS = ((0xAB, 0xCD), (0xEF, 0x12))


def _native_calls_only(session: gpumem.Session) -> None:
    """From here on, a handoff that reached the driver's own wait fails loudly."""

    def refused(event: Any, stream: int) -> None:
        raise AssertionError("the stream wait went through the driver's call, not the lease's native call")

    session.driver.stream_wait = refused  # type: ignore[method-assign]


def handoff_orders_gpu_work() -> None:
    with gpumem.connect(0, name=OWNER) as s:
        w = workload(s, shared=True)
        w.arena.share(BORROWER)
        w.sync()
        region = _region(s, w.pool, 4 * MiB)
        other = Peer(["handoff_peer", str(w.pool.id)])
        other.expect("READY")
        for number, (ours, theirs) in enumerate(HANDOFF_ROUNDS, start=1):
            if number == 2:
                _native_calls_only(s)
            lease = s.replay(w.pool, label="slow writer")
            other.send("borrow")  # it waits on the slot's futex
            time.sleep(0.3)
            _slow_fill(s, region, ours)
            lease.release()  # no synchronize: the event carries the order
            other.expect(f"SAW {ours:02X}")
            other.send("give back")
            # the other way round: the borrower's queued write is ordered before our replay
            time.sleep(0.3)
            with s.replay(w.pool, wait=10.0, label="reader"):
                assert _reads(s, region, theirs), f"round {number}: the replay lease came before the borrower's queued write finished"
            assert s.leasing.handoff_waits == number, f"one wait on the borrower's event a round expected, saw {s.leasing.handoff_waits}"
        other.send("done")  # only now: the daemon forgets a finished client's event
        other.finish("handoff_peer")
        # one process alone: stream order, no waits
        with s.replay(w.pool):
            pass
        with s.replay(w.pool):
            pass
        assert s.leasing.handoff_waits == len(HANDOFF_ROUNDS)
    print("PASS handoff_orders_gpu_work")


def handoff_peer(pool_id: str) -> None:
    with gpumem.connect(0, name=BORROWER) as s:
        s.attach_arena(ARENA)
        pool = s.open_graph_pool(int(pool_id))
        assert pool.shared and pool.owner == OWNER
        region = _region(s, pool, 4 * MiB)
        print("READY", flush=True)
        for number, (theirs, ours) in enumerate(HANDOFF_ROUNDS, start=1):
            if number == 2:
                _native_calls_only(s)
            assert sys.stdin.readline().strip() == "borrow"
            lease = gpumem.Lease.acquire(s.leasing, pool, LeaseKind.BORROW, "handoff", 10.0)
            assert s.leasing.handoff_waits == number, "taking the lease from another process must wait on its event"
            assert _reads(s, region, theirs), f"round {number}: the borrow lease came before the owner's queued write finished"
            print(f"SAW {theirs:02X}", flush=True)
            assert sys.stdin.readline().strip() == "give back"
            _slow_fill(s, region, ours)
            lease.release()
        assert sys.stdin.readline().strip() == "done"
    print("PASS handoff_peer")


def handoff_without_wait_reads_stale_bytes() -> None:
    """The control for handoff_orders_gpu_work, on CUDA: the same handoff with the taker's
    stream wait switched off (in the peer, below) must let the taker see the releaser's
    slow write unfinished. It shows that the check there can fail: the order it sees
    comes from the event, not from the lease's timing."""
    with gpumem.connect(0, name=OWNER) as s:
        w = workload(s, shared=True)
        w.arena.share(BORROWER)
        w.sync()
        region = _region(s, w.pool, 4 * MiB)
        other = Peer(["unordered_peer", str(w.pool.id)])
        other.expect("READY")
        lease = s.replay(w.pool, label="slow writer")
        other.send("borrow")
        time.sleep(0.3)
        _slow_fill(s, region, 0xAB)
        lease.release()
        other.expect("SAW STALE")
        other.send("done")
        other.finish("unordered_peer")
    print("PASS handoff_without_wait_reads_stale_bytes")


def unordered_peer(pool_id: str) -> None:
    with gpumem.connect(0, name=BORROWER) as s:
        s.attach_arena(ARENA)
        pool = s.open_graph_pool(int(pool_id))
        region = _region(s, pool, 4 * MiB)
        s.driver.stream_wait = lambda event, stream: None  # type: ignore[method-assign]
        print("READY", flush=True)
        assert sys.stdin.readline().strip() == "borrow"
        lease = gpumem.Lease.acquire(s.leasing, pool, LeaseKind.BORROW, "unordered", 10.0)
        assert s.leasing.handoff_waits == 1, "the handoff path ran (its wait switched off)"
        assert not _reads(s, region, 0xAB), "without the stream wait the taker still saw the finished write"
        print("SAW STALE", flush=True)
        lease.release()
        assert sys.stdin.readline().strip() == "done"
    print("PASS unordered_peer")


def wait_for_turn(session: gpumem.Session, pool: gpumem.GraphPool, last: bool) -> None:
    """Strict alternation: after a release, wait until the other process has had the
    pool (its release recorded its event, so the slot's handoff names it). Without this
    the releaser, a few microseconds from its next acquire, would mostly win again."""
    if last:
        return
    me = lease_table.word_session(session.session_id)
    deadline = time.monotonic() + 30.0
    while pool.segment.handoff() == me:
        if time.monotonic() > deadline:
            raise AssertionError("the other process did not take the pool within 30 s")
        time.sleep(0.00005)


def torture(iterations: str) -> None:
    n = int(iterations)
    with gpumem.connect(0, name=OWNER) as s:
        w = workload(s, shared=True)
        w.arena.share(BORROWER)
        w.sync()
        other = Peer(["torture_borrower", str(w.pool.id), iterations])
        other.expect("READY")
        other.send("go")
        started = time.monotonic()
        for i in range(n):
            with s.replay(w.pool, wait=30.0, label="decode"):
                w.replay()
                out = w.output()
            w.check(out)  # after the release: the borrower may hold the pool by now
            wait_for_turn(s, w.pool, i == n - 1)
        other.finish("torture_borrower")
        print(f"owner: {n} replays checked in {time.monotonic() - started:.1f}s, {s.leasing.handoff_waits} waits on the borrower's event")
        assert s.leasing.handoff_waits >= n - 1, f"the processes did not alternate ({s.leasing.handoff_waits} handoffs in {n})"
    print("PASS torture")


def torture_borrower(pool_id: str, iterations: str) -> None:
    n = int(iterations)
    with gpumem.connect(0, name=BORROWER) as s:
        s.attach_arena(ARENA)
        pool = s.open_graph_pool(int(pool_id))
        print("READY", flush=True)
        assert sys.stdin.readline().strip() == "go"
        result: Any = None
        if s.backend == "cuda":
            import torch

            result = torch.zeros((), dtype=torch.bool, device="cuda")  # outside the borrow: it outlives the scope
        for i in range(n):
            value = 1 + i % 250
            with s.borrow(pool, user="draft probs", wait=30.0) as b:
                block = fill(s, b, 8 * MiB, value)
                assert in_runs(pool, address(block), 8 * MiB)
                check = holds(block, value)  # queued inside the lease, read after it
                if s.backend == "cuda":
                    result.copy_(check)
                else:
                    result = check
                del block, check
            assert bool(result), f"borrow {i}: the borrowed bytes changed within the lease"
            wait_for_turn(s, pool, i == n - 1)
        assert s.leasing.handoff_waits >= n - 1, f"the processes did not alternate ({s.leasing.handoff_waits} handoffs in {n})"
        print(f"borrower: {n} borrows checked, {s.leasing.handoff_waits} waits on the owner's event, "
              f"{s.borrow_pools[pool.id].builds} borrow-pool builds", file=sys.stderr)
    print("PASS torture_borrower")


def raw_scopes_keep_their_torch_pool() -> None:
    """Scopes of raw views free their blocks back to the slot, so each entry rebuilds on
    the runs; the torch pool, which never held a segment, stays the same one (an engine
    doing this in a loop died of SIGSEGV while pools were dropped and made anew)."""
    with gpumem.connect(0, name=OWNER) as s:
        w = workload(s)
        pools: list[object] = []  # each new torch pool (held: an id could be reused)
        for i in range(40):
            with s.borrow(w.pool, user="raw") as b:
                view = b.allocate(MiB)
                s.driver.write(view.address, f"raw {i}".encode())
                assert s.driver.read(view.address, len(f"raw {i}")) == f"raw {i}".encode()
                del view
            bp = s.borrow_pools[w.pool.id]
            if not pools or pools[-1] is not bp.torch_pool:
                pools.append(bp.torch_pool)
        assert bp.torch_pool is not None and len(pools) == 1, f"{len(pools)} torch pools for one borrow pool"
        assert bp.builds >= 39, bp.builds  # the entries after frees rebuilt on the runs
    print("PASS raw_scopes_keep_their_torch_pool")


SCENARIOS = {
    f.__name__: f
    for f in (
        in_runs_and_no_new_memory,
        oom_and_can_fit,
        escape_is_caught,
        escaped_peer_refused,
        peer_replays,
        rebuild_rules,
        raw_scopes_keep_their_torch_pool,
        stream_binding,
        cublas_warmed_before_first_borrow,
        handoff_orders_gpu_work,
        handoff_peer,
        handoff_without_wait_reads_stale_bytes,
        unordered_peer,
        torture,
        torture_borrower,
    )
}

if __name__ == "__main__":
    if "GPUMEMD_RUNTIME_DIR" not in os.environ:
        sys.exit("set GPUMEMD_RUNTIME_DIR to the daemon's runtime directory")
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
