"""Who may still write a retain group's memory: the fence its adoption waits out.

Every writer, not the last holder alone: the holder's process (gone from /proc, and on
CUDA from NVML's list: fencing.py), every other session that maps the group's memory (a
sharer its dead owner admitted: live, it keeps the adoption waiting until it releases;
ended, its process is fenced as the holder's is), and, on the host backend, any process
that maps the memory with no session at all (a child a dead writer forked, which keeps
its mappings with every descriptor closed: /proc/PID/maps). A writer the daemon knows by
no pid (another pid namespace: SO_PEERCRED says 0) is fenced by its session's end.
docs/architecture.md ("Fencing") says what each deployment guarantees.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from gpumem_shared import protocol as p

from gpumemd.arenas import ArenaBook
from gpumemd.fencing import Fence, processes_mapping
from gpumemd.records import GroupRecord, SessionRecord

# A dead writer the daemon knows by no pid (it runs in another pid namespace: SO_PEERCRED
# says 0) is fenced by its session's end, its fd channel's hang-up, which on the host
# backend comes after its address space is gone. On CUDA its context may outlive the
# descriptors by some milliseconds (bench/fence_probe.py: writes 13 ms after kill -9,
# EOF at 4-6 ms, NVML's drop at 31-34 ms), and no NVML pid can be matched to it: an
# adoption waits this long after the hang-up instead, some 30 times what the probe saw.
HIDDEN_SETTLE_S = 1.0
# Ended sharers of one group whose fence an adoption waits for: one per process (pid),
# so a loop of sessions cannot grow it; past the bound the oldest fenced ones go first.
MAX_WRITERS = 64
# How long a scan of /proc that found a process still mapping a group's memory stands for
# the next look (the server's loop looks every 10 ms while an adoption waits).
RESCAN_S = 0.1


class WriterFence:
    """The retain book's fence (``fence``: the process check, a stand-in in unit tests)."""

    def __init__(self, arenas: ArenaBook, sessions: Mapping[int, SessionRecord], clock: Callable[[], float], fence: Fence) -> None:
        self.arenas = arenas
        self.sessions = sessions
        self.clock = clock
        self.fence = fence
        self._scanned: tuple[float, str, list[int]] = (0.0, "", [])  # (until, group, pids): RESCAN_S

    def not_fenced(self, pid: int, since: float, ended: float) -> str:
        """Why a writer whose session ended may still write (""; fenced). A pid the daemon
        cannot see (0) leaves its session's end as the proof: see HIDDEN_SETTLE_S."""
        if pid > 0:
            return self.fence(pid, since)
        left = ended + HIDDEN_SETTLE_S - self.clock()
        if self.arenas.driver.kind == "cuda" and left > 0:
            return f"its process is in another pid namespace; its session ended {HIDDEN_SETTLE_S - left:.3f}s ago, and its GPU work may run {left:.3f}s more"
        return ""

    def _still_mapped(self, group: GroupRecord) -> list[int]:
        """On the host backend, the processes that map the group's chunks once no session
        does (the caller checked): children its dead writers forked, which keep their
        mappings. On CUDA none can: a forked child cannot use its parent's context."""
        if self.arenas.driver.kind != "host":
            return []
        now, key = self.clock(), f"{group.uid}/{group.name}"
        until, scanned, pids = self._scanned
        if scanned == key and now < until:
            return pids
        files: set[tuple[int, int]] = set()
        for name in group.objects:
            for chunk in self.arenas.by_name[name].chunks:
                st = os.fstat(self.arenas.driver.chunk_fd(chunk.handle))
                files.add((st.st_dev, st.st_ino))
        pids = processes_mapping(files, os.getpid())
        self._scanned = (now + RESCAN_S, key, pids) if pids else (0.0, "", [])
        return pids

    def mapper_ids(self, group: GroupRecord) -> set[int]:
        """The sessions that attach or map any of the group's memory (its objects' chunks,
        retiring ones too)."""
        names = set(group.objects)
        ids: set[int] = set()
        for name in group.objects:
            arena = self.arenas.by_name[name]
            ids |= arena.attached
            for chunk in arena.chunks:
                ids |= chunk.holders
        for chunk in self.arenas.retiring.values():
            if chunk.arena in names:
                ids |= chunk.holders
        return ids

    def mappers(self, group: GroupRecord, skip: int) -> list[SessionRecord]:
        return [self.sessions[i] for i in sorted(self.mapper_ids(group) - {skip}) if i in self.sessions]

    def check(self, group: GroupRecord, adopter: int) -> None:
        """NOT_FENCED while a writer of the group's memory may still write it: its last
        holder, a live session that maps it, a sharer that ended, a process that maps it
        with no session (host backend); the error names it and says what to check."""
        holder = f"its last holder, client '{group.previous}', may still write its memory"
        self._refuse_unfenced(group, holder, group.previous_pid, group.previous_since, group.previous_ended)
        live = self.mappers(group, adopter)
        if live:
            named = ", ".join(f"client '{m.name}' ({m.pids}, session {m.id}, uid {m.uid})" for m in live)
            raise p.ProtocolError(
                p.ErrorCode.NOT_FENCED,
                f"retain group '{group.name}' is not adoptable yet: {named} still map its memory under a grant of its dead "
                "owner; an adopter gets it once no other process does: release the arenas there (they were told), or end "
                "those clients",
                group=group.name,
                pid=live[0].pid,
                sharers=len(live),
            )
        for label, pid, since, ended in group.writers:
            self._refuse_unfenced(group, f"{label}, which mapped its memory, ended but may still write it", pid, since, ended)
        lingering = self._still_mapped(group)
        if lingering:
            raise p.ProtocolError(
                p.ErrorCode.NOT_FENCED,
                f"retain group '{group.name}' is not adoptable yet: process(es) {', '.join(map(str, lingering))} still map its "
                "memory with no session of theirs (a forked child of a dead holder or sharer, by /proc/PID/maps); they "
                "must exit first",
                group=group.name,
                pid=lingering[0],
            )

    def _refuse_unfenced(self, group: GroupRecord, writer: str, pid: int, since: float, ended: float) -> None:
        """NOT_FENCED, saying ``writer`` and why, while that writer whose session ended may still write."""
        why = self.not_fenced(pid, since, ended)
        if why:
            raise p.ProtocolError(
                p.ErrorCode.NOT_FENCED,
                f"retain group '{group.name}' is not adoptable yet: {writer} ({why}); try again",
                group=group.name,
                pid=pid,
            )

    def wrote(self, group: GroupRecord, s: SessionRecord, now: float) -> None:
        """``s``, which mapped the group's memory, ended: kept for the fence, once per process."""
        label = f"client '{s.name}' ({s.pids}, session {s.id})"
        same = [w for w in group.writers if s.pid > 0 and w[1] == s.pid]
        if same:  # the process's earliest HELLO: a pid reused since is still told apart
            return
        if len(group.writers) >= MAX_WRITERS:
            group.writers = [w for w in group.writers if self.not_fenced(w[1], w[2], w[3])][-(MAX_WRITERS - 1) :]
        group.writers.append((label, s.pid, s.since, now))

