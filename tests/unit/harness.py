"""Helpers for the unit tier: a ``DaemonState`` on the real host driver behind a few
terse calls, and probes of what the process really holds (descriptors, mappings)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from gpumem_shared import protocol as p
from gpumem_shared.driver.host import HOST_GRANULARITY, HostDriver
from gpumemd.config import StateConfig
from gpumemd.records import Outcome, SessionRecord as Session
from gpumemd.state import DaemonState

MiB = 1 << 20
GiB = 1 << 30
G = HOST_GRANULARITY  # 2 MiB
CAPACITY = 256 * MiB
BULK = 16 * MiB
# Windows are planned upwards from StateConfig.va_base; no test plans beyond this span of it.
# (The default plan range runs up to 0x6000_0000_0000, which on x86-64 also holds the
# PIE executable and its brk heap, so the whole range is not ours to watch.)
WATCHED_SPAN = 1 << 40


def open_fds() -> int:
    """Descriptors open in this process (listing the directory opens one more, always)."""
    return len(os.listdir("/proc/self/fd"))


def windows(h: Harness) -> list[tuple[int, int]]:
    """Mappings in the part of the plan range the tests use."""
    return mapped_ranges(h.config.va_base, h.config.va_base + WATCHED_SPAN)


def the_slice(h: Harness) -> tuple[int, int]:
    """The address slice the daemon reserves at start, whole: its only reservation."""
    return h.config.va_base, h.config.va_limit


def planned(h: Harness) -> list[tuple[int, int]]:
    """The windows the daemon plans in its slice (placeholder scratch included), by address."""
    return sorted((a.address, a.address + a.window) for a in h.state.arenas.by_name.values())


def mapped_ranges(lo: int, hi: int) -> list[tuple[int, int]]:
    """Mappings of this process that intersect [lo, hi), from /proc/self/maps."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            start_s, end_s = line.split()[0].split("-")
            start, end = int(start_s, 16), int(end_s, 16)
            if start < hi and lo < end:
                out.append((start, end))
    return out


def is_reserved(address: int, size: int) -> bool:
    """Whether [address, address + size) is entirely covered by mappings."""
    covered = address
    for start, end in sorted(mapped_ranges(address, address + size)):
        if start > covered:
            return False
        covered = max(covered, end)
    return covered >= address + size


class DescriptorFreeDriver(HostDriver):
    """The host driver without memfds: chunks are bookkeeping only, so a test can make
    thousands without spending the process's descriptors."""

    def create_chunks(self, placements: list[tuple[int, int]]) -> list[int]:
        return [-1] * len(placements)

    def destroy_chunks(self, placements: list[tuple[int, int]], handles: list[int]) -> None:
        pass


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Harness:
    """A DaemonState plus terse helpers; tests still assert on ``state`` directly."""

    def __init__(self, state: DaemonState, clock: Clock, wall_clock: Clock) -> None:
        self.state = state
        self.clock = clock
        self.wall_clock = wall_clock
        self._pid = 4000

    @property
    def config(self) -> StateConfig:
        return self.state.config

    def connect(
        self, name: str, uid: int = 1000, gid: int = 1000, *, pid: int | None = None, own_pid: int = 0, tenant_token: str = ""
    ) -> Session:
        """A session as SO_PEERCRED would describe it: a fresh pid (or ``pid``: 0 for a
        client outside the daemon's pid namespace), ``uid`` and ``gid``; ``own_pid``: the
        pid its HELLO says (0: none, as before 1.9); ``tenant_token``: the one its HELLO
        presents (since 1.11)."""
        self._pid += 1
        kernel = self._pid if pid is None else pid
        hello = p.Hello(name=name, pid=own_pid, tenant_token=tenant_token)
        session, _ = self.state.open_session(hello, pid=kernel, uid=uid, gid=gid)
        return session

    def ok(self, session: Session | None, message: Any) -> Outcome:
        return self.state.handle(session, message)

    def refused(self, session: Session | None, message: Any, code: p.ErrorCode) -> p.ProtocolError:
        with pytest.raises(p.ProtocolError) as info:
            self.state.handle(session, message)
        assert info.value.code == code, f"expected {code.name}, got {info.value.code.name}: {info.value.message}"
        return info.value

    def create(self, session: Session, name: str, reserve: int = 1 * GiB) -> p.ArenaView:
        return self.ok(session, p.CreateArena(name=name, reserve_bytes=reserve)).reply.arena

    def commit(self, session: Session, name: str, nbytes: int) -> Outcome:
        return self.ok(session, p.CommitArena(name=name, nbytes=nbytes))

    def decommit(self, session: Session, name: str, to_nbytes: int) -> Outcome:
        return self.ok(session, p.DecommitArena(name=name, to_nbytes=to_nbytes))

    def share(self, session: Session, name: str, client: str = "", *, uid: int = -1, gid: int = -1) -> str:
        """A new grant on the arena; returns its token."""
        reply = self.ok(session, p.ShareArena(name=name, client=client, uid=uid, gid=gid)).reply
        assert isinstance(reply, p.ShareReply)
        return reply.token

    def attach(self, session: Session, name: str, token: str = "") -> Outcome:
        return self.ok(session, p.AttachArena(name=name, token=token))

    def sync(self, session: Session, name: str) -> Outcome:
        return self.ok(session, p.SyncArena(name=name))

    def unmapped(self, session: Session, name: str, chunk_ids: list[int]) -> None:
        self.ok(session, p.ChunksUnmapped(name=name, chunk_ids=chunk_ids))

    def release(self, session: Session, name: str) -> Outcome:
        return self.ok(session, p.ReleaseArena(name=name))
