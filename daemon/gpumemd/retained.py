"""The retain book: retain groups, the arenas and KV pools kept for them when their
holder ends without releasing them, and their adoption by another session.

A group belongs to the uid that opened it and is held by one session at a time; group
names are each uid's own (as arena names are: names.py), so no uid can take a name
another uid's engine needs, and a group is found by its uid and name. Its
secret (256 random bits) is granted to the session that opens it; the holder hands it
to the process that may take over (a standby, a supervisor's restarted engine), out of
band. When the holder's session ends with retained objects still its own (the process
died, or did not resume after a restart), they are *orphaned*: not reclaimed, still
accounted and counted against the uid, until the group's deadline (``--retain-grace``).
A session of the same uid that gives the secret adopts them once the dead holder is
fenced (fencing.py): it becomes their owner, maps their chunks at the same addresses,
and confirms (ADOPT_DONE). Until it confirms, its own death puts them back as they
were, orphaned with the same deadline, so a crashing adopter cannot keep them forever.

Secrets are compared in constant time, never leave the daemon but to the holder, and
stay out of status, the log and repr. The book decides who may adopt and when (an
ADOPT given a ``wait`` is answered once it may: deferred, like a KV grow); moving an
arena's ownership is the arena and KV books' (``transfer``), and what a session's end
means for the arenas it leaves is the dispatcher's (state.py).
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import secrets
from collections.abc import Callable, Mapping

import msgspec

from gpumem_shared import protocol as p

from gpumemd.arenas import ArenaBook, map_batches
from gpumemd.checks import check_name
from gpumemd.config import StateConfig
from gpumemd.fencing import Fence
from gpumemd.image import Image, Imager
from gpumemd.kv_pools import KvBook
from gpumemd.logs import SessionThrottle
from gpumemd.records import ChunkRecord, Completion, GroupRecord, Notices, Outcome, PendingWait, SessionRecord, wait_deadline
from gpumemd.retain_fence import WriterFence
from gpumemd.sleepers import SleeperBook

log = logging.getLogger("gpumemd.retained")

SECRET_BYTES = 32
# Groups one uid may keep (held or orphaned): a loop opening groups cannot grow the
# daemon without end.
MAX_GROUPS_PER_UID = 64


@dataclasses.dataclass(eq=False)
class PendingAdopt(PendingWait):
    """An ADOPT waiting (its ``wait``) for its group's holder to end, or to be fenced."""

    group: str
    who: str  # how the log names the adopter
    holder: int  # the group's holder when it came (0: orphaned, its last holder not fenced)
    uid: int  # the group's uid: with its name, its key


class RetainBookImage(msgspec.Struct):
    groups: list[Image]


_GROUP = Imager(GroupRecord)


class RetainBook:
    def __init__(
        self,
        arenas: ArenaBook,
        kv: KvBook,
        sleepers: SleeperBook,
        sessions: Mapping[int, SessionRecord],
        config: StateConfig,
        clock: Callable[[], float],
        fence: Fence,
    ) -> None:
        self.arenas = arenas
        self.kv = kv
        self.sleepers = sleepers
        self.sessions = sessions
        self.config = config
        self.clock = clock
        self.writers = WriterFence(arenas, sessions, clock, fence)
        self.groups: dict[tuple[int, str], GroupRecord] = {}  # by (uid, name): each uid names its own
        self.adopts: list[PendingAdopt] = []
        self._completions: list[Completion] = []
        self._refusals = SessionThrottle(log)  # any session can provoke one at will

    # ------------------------------------------------------------------ lookups

    def _get(self, s: SessionRecord, name: str) -> GroupRecord:
        """``s``'s uid's group ``name``; for a session of another uid, another uid's group of
        that name (a refusal then says whose it is; only its own uid may touch it)."""
        group = self.groups.get((s.uid, name)) or next((g for g in self.groups.values() if g.name == name), None)
        if group is None:
            raise p.ProtocolError(
                p.ErrorCode.NOT_FOUND, f"uid {s.uid} has no retain group named '{name}' on device {self.arenas.device.index}", group=name
            )
        return group

    def _holder_label(self, group: GroupRecord) -> str:
        s = self.sessions.get(group.holder)
        return f"client '{s.name}' (pid {s.pid}, session {s.id})" if s else f"session {group.holder}"

    def _held(self, group: GroupRecord) -> p.ProtocolError:
        s = self.sessions.get(group.holder)
        how = "adopted it and has not confirmed yet" if group.adopting else "holds it"
        return p.ProtocolError(
            p.ErrorCode.GROUP_HELD,
            f"retain group '{group.name}' is held: {self._holder_label(group)} {how}; it can be adopted once that "
            "session ends without releasing it",
            group=group.name,
            holder=s.name if s else "",
            holder_pid=s.pid if s else 0,
            holder_session=group.holder,
            adopting=int(group.adopting),
        )

    def group_of(self, name: str) -> GroupRecord | None:
        return next((g for g in self.groups.values() if name in g.objects), None)

    def orphaned(self, name: str) -> bool:
        """Whether arena ``name`` is kept for an adopter: nobody attached is no reason to
        release it."""
        group = self.group_of(name)
        return group is not None and not group.holder

    # ------------------------------------------------------------------ requests

    def open(self, s: SessionRecord, m: p.RetainGroup) -> Outcome:
        check_name(m.group, "retain group name")
        group = self.groups.get((s.uid, m.group))  # another uid's of this name is no obstacle: names are each uid's
        if group is not None and group.holder == s.id:
            return Outcome(p.RetainGroupReply(group=group.name, secret=group.secret.decode()))
        if group is not None:
            if group.holder:
                raise self._held(group)
            raise p.ProtocolError(
                p.ErrorCode.ALREADY_EXISTS,
                f"retain group '{m.group}' is orphaned (its holder {group.previous!r}, pid {group.previous_pid}, ended): "
                "adopt it with its secret, or choose another name",
                group=m.group,
            )
        mine = sum(1 for g in self.groups.values() if g.uid == s.uid)
        if mine >= MAX_GROUPS_PER_UID:
            raise p.ProtocolError(
                p.ErrorCode.RESOURCE_EXHAUSTED,
                f"uid {s.uid} keeps {mine} retain groups, the most one uid may; release what they retain first",
                limit="retain-groups",
                uid=s.uid,
                used=mine,
                cap=MAX_GROUPS_PER_UID,
            )
        group = GroupRecord(name=m.group, uid=s.uid, secret=secrets.token_hex(SECRET_BYTES).encode(), holder=s.id)
        self.groups[group.uid, group.name] = group
        log.info("retain group %r opened by client %r (pid %d, uid %d)", group.name, s.name, s.pid, s.uid)
        return Outcome(p.RetainGroupReply(group=group.name, secret=group.secret.decode()))

    def mark(self, s: SessionRecord, m: p.Retain) -> Outcome:
        group = self._get(s, m.group)
        if group.holder != s.id:
            raise p.ProtocolError(
                p.ErrorCode.PERMISSION_DENIED,
                f"retain group '{group.name}' is not held by this session ({self._holder_label(group) if group.holder else 'it is orphaned'})",
                group=group.name,
            )
        arena = self.arenas.owned(s, m.name, "retain", kv_ok=True)
        other = self.group_of(arena.name)
        if not m.retained:
            if other is not group:
                raise p.ProtocolError(p.ErrorCode.NOT_FOUND, f"'{arena.name}' is not retained for group '{group.name}'", group=group.name)
            group.objects.remove(arena.name)
            log.info("retain group %r: %r no longer retained", group.name, arena.name)
            return Outcome(p.Ack())
        if other is not None and other is not group:
            raise p.ProtocolError(
                p.ErrorCode.ALREADY_EXISTS, f"'{arena.name}' is retained for group '{other.name}' already", group=other.name
            )
        if other is None:
            group.objects.append(arena.name)
            log.info("retain group %r: %r retained (%d bytes committed)", group.name, arena.name, arena.committed)
        return Outcome(p.Ack())

    def _admit(self, s: SessionRecord, group: GroupRecord, secret: str, what: str) -> str:
        """PERMISSION_DENIED unless ``s`` is of the group's uid and gives its secret;
        returns how the log names ``s``."""
        who = f"client '{s.name}' (pid {s.pid}, uid {s.uid})"
        # The secret is compared whatever else refuses: how long a refusal takes says
        # nothing about how close a guess came.
        right = hmac.compare_digest(group.secret, secret.encode())
        if group.uid != s.uid:
            self._refusals.warning(
                s.id, self.clock(), "retain group %r: %s by %s refused: the group belongs to uid %d", group.name, what, who, group.uid
            )
            raise p.ProtocolError(
                p.ErrorCode.PERMISSION_DENIED,
                f"retain group '{group.name}' belongs to uid {group.uid}; this session is uid {s.uid}: only a process of "
                f"the group's uid may {what} it, secret or not",
                group=group.name,
                uid=s.uid,
            )
        if not right:
            self._refusals.warning(s.id, self.clock(), "retain group %r: %s by %s refused: wrong secret", group.name, what, who)
            raise p.ProtocolError(p.ErrorCode.PERMISSION_DENIED, f"wrong secret for retain group '{group.name}'", group=group.name)
        return who

    def reserve(self, s: SessionRecord, m: p.RetainReserve) -> Outcome:
        """Where the group's objects lie, for a standby's placeholder: their windows stay
        planned while the group lives (held or orphaned), so the standby's own arenas
        never land there."""
        group = self._get(s, m.group)
        self._admit(s, group, m.secret, "reserve")
        objects = []
        for name in group.objects:
            view = self.arenas.view(self.arenas.by_name[name])
            pool = self.kv.pools.get(name)
            objects.append(p.AdoptedObject(arena=view, chunks=[], kv=pool.view(view) if pool else None))
        return Outcome(p.ReserveReply(group=group.name, objects=objects))

    def adopt(self, s: SessionRecord, m: p.Adopt, request_id: int) -> Outcome:
        """Adopt now if the group can be; else, given a ``wait``, answer once it can be
        (deferred: the holder ended, the fence passed) or at the wait's end with why not.
        Another adopter that comes first ends the wait at once."""
        group = self._get(s, m.group)
        who = self._admit(s, group, m.secret, "adopt")
        deadline = wait_deadline(m.wait, self.clock(), f"adopting retain group '{group.name}'")
        try:
            return self._adopt(s, group, who)
        except p.ProtocolError as exc:
            if m.wait <= 0 or exc.code not in (p.ErrorCode.GROUP_HELD, p.ErrorCode.NOT_FENCED) or group.adopting:
                raise
            if any(a.session_id == s.id and a.group == group.name for a in self.adopts):
                raise p.ProtocolError(
                    p.ErrorCode.ALREADY_EXISTS, f"this session waits to adopt retain group '{group.name}' already", group=group.name
                ) from None
        self.adopts.append(
            PendingAdopt(s.id, request_id, self.clock(), deadline, group=group.name, who=who, holder=group.holder, uid=group.uid)
        )
        log.info("retain group %r: %s waits up to %gs to adopt it (%s)", group.name, who, m.wait,
                 f"held by {self._holder_label(group)}" if group.holder else "not fenced yet")
        return Outcome(None)

    def settle(self) -> None:
        """Answer the waiting adoptions that can go ahead now, those another adopter came
        first to, and those whose wait ended: called when a session ends and on the tick."""
        now = self.clock()
        for wait in list(self.adopts):
            s, group = self.sessions.get(wait.session_id), self.groups.get((wait.uid, wait.group))
            answer: p.Message | p.ProtocolError
            handout: list[ChunkRecord] = []
            if s is None:
                self.adopts.remove(wait)  # nobody to answer
                continue
            if group is None:
                answer = p.ProtocolError(p.ErrorCode.NOT_FOUND, f"retain group '{wait.group}' went while this session waited to adopt it")
            else:
                try:
                    outcome = self._adopt(s, group, wait.who)
                except p.ProtocolError as exc:
                    # Held by another than the holder it waited for (or adopted, not confirmed): an adopter came first.
                    first = exc.code is p.ErrorCode.GROUP_HELD and (group.adopting or group.holder != wait.holder)
                    if now < wait.deadline and not first and exc.code in (p.ErrorCode.GROUP_HELD, p.ErrorCode.NOT_FENCED):
                        continue
                    answer = exc
                else:
                    assert outcome.reply is not None
                    answer, handout = outcome.reply, outcome.handout
            self.adopts.remove(wait)
            self._completions.append(Completion(wait.session_id, wait.request_id, answer, handout))

    def fencing(self) -> bool:
        """Whether an adoption waits for a dead holder's fence: polled, nothing announces it."""
        return any(not g.holder for g in (self.groups.get((a.uid, a.group)) for a in self.adopts) if g is not None)

    def take_completions(self) -> list[Completion]:
        out, self._completions = self._completions, []
        return out

    def has_mail(self) -> bool:
        return bool(self._completions)

    def _adopt(self, s: SessionRecord, group: GroupRecord, who: str) -> Outcome:
        if group.holder == s.id:
            raise p.ProtocolError(p.ErrorCode.ALREADY_EXISTS, f"this session holds retain group '{group.name}' already", group=group.name)
        if group.holder:
            raise self._held(group)
        self.writers.check(group, s.id)
        attached = [n for n in group.objects if s.id in self.arenas.by_name[n].attached]
        if attached:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"this session is attached to {attached} of retain group '{group.name}' already; release them, then adopt",
                group=group.name,
            )
        moving = [self.arenas.by_name[n] for n in group.objects]
        self.arenas.caps.check_move(moving, s.uid, s.gid, s.tenant_key, f"adopting retain group '{group.name}'")
        group.holder, group.adopting = s.id, True
        handout: list[ChunkRecord] = []
        objects = []
        for name in group.objects:
            arena = self.arenas.by_name[name]
            self.arenas.transfer(arena, s)
            self.kv.transfer(name, s)
            self.sleepers.transfer(name, s)
            chunks = self.arenas.hand(s, list(arena.chunks))
            handout += chunks
            view = self.arenas.view(arena)
            pool = self.kv.pools.get(name)
            objects.append(p.AdoptedObject(arena=view, chunks=[c.view() for c in chunks], kv=pool.view(view) if pool else None))
        left = 0.0 if group.deadline is None else group.deadline - self.clock()
        previous = f"client '{group.previous}' (pid {group.previous_pid})"
        waited = [previous] + [label for label, _, _, _ in group.writers]
        group.writers = []
        log.info(
            "retain group %r adopted by %s from %s: %d object(s), %d bytes", group.name, who, previous, len(objects),
            sum(c.size for c in handout),
        )
        reply = p.AdoptReply(
            group=group.name, objects=objects, fd_batches=map_batches(len(handout)), previous=previous, deadline_in_s=round(left, 3),
            waited_for=waited,
        )
        return Outcome(reply, handout=handout)

    def adopt_done(self, s: SessionRecord, m: p.AdoptDone) -> Outcome:
        group = self._get(s, m.group)
        if group.holder != s.id:
            raise p.ProtocolError(p.ErrorCode.PERMISSION_DENIED, f"this session does not hold retain group '{group.name}'", group=group.name)
        if group.adopting:
            group.adopting, group.deadline = False, None
            log.info("retain group %r: adoption by client %r confirmed", group.name, s.name)
        return Outcome(p.Ack())

    def check_attach(self, name: str) -> None:
        """An orphaned object (or one whose adoption is not confirmed) reaches its adopter
        alone: a grant its dead owner made admits nobody to it meanwhile."""
        group = self.group_of(name)
        if group is not None and (not group.holder or group.adopting):
            raise p.ProtocolError(
                p.ErrorCode.PERMISSION_DENIED,
                f"arena '{name}' is retained for group '{group.name}', whose holder ended: only the session that adopts "
                "the group (with its secret) may map it",
                arena=name,
                group=group.name,
            )

    # ------------------------------------------------------------------ what others change

    def session_ended(self, session: SessionRecord, notices: Notices) -> None:
        """``session`` ended without releasing what it retained: the objects of the groups
        it held are orphaned (``orphaned`` says so to the dispatcher, which must not
        reclaim them), and the sessions that still map them are told to let go (an
        adoption waits for them); a group it held with nothing left goes. Where it mapped
        another's group's memory, an adoption of that group waits for its fence too."""
        now = self.clock()
        for group in self.groups.values():
            if group.holder != session.id and session.id in self.writers.mapper_ids(group):
                self.writers.wrote(group, session, now)
        for group in [g for g in self.groups.values() if g.holder == session.id]:
            group.objects = [n for n in group.objects if n in self.arenas.by_name and self.arenas.by_name[n].owner_id == session.id]
            if not group.objects:
                del self.groups[group.uid, group.name]
                continue
            if not group.adopting or group.deadline is None:
                group.deadline = self.clock() + self.config.retain_grace
            was_adopting = group.adopting
            group.holder, group.adopting = 0, False
            group.previous, group.previous_pid, group.previous_since = session.name, session.pid, session.since
            group.previous_ended = now
            for sharer in self.writers.mappers(group, session.id):
                for name in group.objects:
                    message = (
                        f"arena '{name}''s owner ended and retain group '{group.name}' keeps it for an adopter, who gets it "
                        "once no other process maps it: release it"
                    )
                    notices.append((sharer.id, p.Notice(kind=p.NoticeKind.ARENA_RETIRED, message=message, arena=name)))
            log.warning(
                "retain group %r orphaned: client %r (pid %d) ended %s; %s kept until adopted, or released in %.0fs",
                group.name, session.name, session.pid, "before confirming its adoption" if was_adopting else "without releasing it",
                ", ".join(group.objects), group.deadline - self.clock(),
                extra={"figures": {"pid": session.pid, "objects": len(group.objects)}},
            )

    def forget(self, name: str) -> None:
        """Arena ``name`` is gone: no group retains it; an orphaned group left empty goes."""
        group = self.group_of(name)
        if group is None:
            return
        group.objects.remove(name)
        if not group.objects and not group.holder:
            del self.groups[group.uid, group.name]

    def expired(self) -> list[str]:
        """The objects of orphaned groups whose deadline passed (the groups go): the
        dispatcher releases them as a dead client's."""
        now = self.clock()
        out: list[str] = []
        for group in [g for g in self.groups.values() if not g.holder and g.deadline is not None and now >= g.deadline]:
            del self.groups[group.uid, group.name]
            log.warning(
                "retain group %r: nobody adopted it within the %gs grace; %s released", group.name, self.config.retain_grace,
                ", ".join(group.objects) or "nothing",
            )
            out += group.objects
        return out

    def status(self) -> list[p.RetainedStatus]:
        now = self.clock()
        out = []
        for g in self.groups.values():
            holder = self.sessions.get(g.holder)
            state = p.RetainState.ADOPTING if g.adopting else p.RetainState.HELD if g.holder else p.RetainState.ORPHANED
            out.append(
                p.RetainedStatus(
                    group=g.name,
                    uid=g.uid,
                    state=state,
                    objects=list(g.objects),
                    committed_bytes=sum(self.arenas.by_name[n].committed for n in g.objects if n in self.arenas.by_name),
                    holder=holder.name if holder else "",
                    holder_pid=holder.pid if holder else 0,
                    previous=g.previous,
                    previous_pid=g.previous_pid,
                    fenced=not g.holder and not self.writers.not_fenced(g.previous_pid, g.previous_since, g.previous_ended),
                    deadline_in_s=-1.0 if g.deadline is None else round(g.deadline - now, 3),
                )
            )
        return out

    # ------------------------------------------------------------------ the durable record

    def image(self) -> RetainBookImage:
        now = self.clock()
        # Times on the book's clock go as seconds from now: a restarted daemon's clock starts anew.
        return RetainBookImage([
            _GROUP.image(
                g, deadline=None if g.deadline is None else g.deadline - now, previous_ended=g.previous_ended - now,
                writers=[(label, pid, since, ended - now) for label, pid, since, ended in g.writers],
            )
            for g in self.groups.values()
        ])

    def restore(self, part: object) -> None:
        """The book as ``image`` left it (the arena and KV books restored first): objects
        whose arena was not rebuilt are dropped, orphaned ones count against the group's
        uid again; a group whose holder was not kept is orphaned."""
        book = msgspec.convert(part, RetainBookImage)
        now = self.clock()
        for group in (_GROUP.restore(g) for g in book.groups):
            group.objects = [n for n in group.objects if n in self.arenas.by_name]
            if group.deadline is not None:
                group.deadline += now
            group.previous_ended += now
            group.writers = [(label, pid, since, ended + now) for label, pid, since, ended in group.writers]
            if group.holder not in self.sessions:
                group.holder, group.adopting = 0, False
                if group.deadline is None:
                    group.deadline = now + self.config.retain_grace
            if not group.objects and not group.holder:
                continue
            if not group.holder:
                for name in group.objects:
                    self.arenas.tenants.owners[name] = group.uid
            self.groups[group.uid, group.name] = group
