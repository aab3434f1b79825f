"""The outbox's promise without sockets: nothing leaves the daemon before the durable
record holds it. Every letter the outbox hands the server is checked against the record
as it stands at that moment (the record a restart would read): the answer remembered
byte for byte, every chunk it hands out stored and no longer fresh, every lease segment
stored; a read-only request writes no record, and one request writes it once."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpumem_shared import fdchannel
from gpumem_shared import protocol as p
from gpumem_shared.driver.base import Handle
from gpumem_shared.driver.host import HostDriver
from gpumemd import arenas
from gpumemd.sessions import _SESSION
from gpumemd.durable import Durable, RecordFile
from gpumemd.image import StateImage, chunk_name, decode, lease_name
from gpumemd.outbox import Letter, Mail, Outbox
from gpumemd.sleepers import host_buffer_name
from gpumemd.records import SessionRecord

from .harness import CAPACITY, Harness, MiB
from .store_kit import FakeStore


def sessions(record: StateImage) -> list[dict[str, Any]]:
    return [_SESSION.fields(s) for s in record.sessions["sessions"]]


def chunks(record: StateImage) -> list[dict[str, Any]]:
    live = [arenas._ARENA.fields(a) for a in record.arenas["arenas"]]
    return [arenas._CHUNK.fields(c) for a in live for c in a["chunks"] + a["placeholders"]]


# Answered from the state as it is, never resent for an answer: the record does not keep them.
READ_ONLY = (p.Ping, p.Status)


def as_mail(to: bytes, out: Mail | bytes) -> Mail:
    """What the server sends for ``out``: a reply that leaves alone is one letter to ``to``."""
    if isinstance(out, Mail):
        return out
    mail = Mail()
    mail.letters.append(Letter(to, out))
    return mail


@dataclasses.dataclass
class Door:
    """An outbox over a state with a store, and the requests a client would send."""

    h: Harness
    store: FakeStore
    durable: Durable
    outbox: Outbox
    next_id: int = 1

    def hello(self, name: str) -> SessionRecord:
        self.h._pid += 1
        session, frame = self.outbox.greet(p.decode_request(p.encode_request(1, p.Hello(name=name))), self.h._pid, 1000, 1000)
        assert p.decode_reply(frame).ok
        record = self.record()
        assert any(s["id"] == session.id and s["credential"] == session.credential != b"" for s in sessions(record)), (
            "the session's resume credential left before the record held it"
        )
        return session

    def send(self, session: SessionRecord, message: p.RequestMessage, request_id: int = 0) -> tuple[int, Mail]:
        if not request_id:
            request_id = self.next_id
            self.next_id += 1
        mail = as_mail(session.token, self.outbox.request(session.token, session, p.encode_request(request_id, message)))
        self.check(mail, remembered=not isinstance(message, READ_ONLY))
        return request_id, mail

    def record(self) -> StateImage:
        payload = RecordFile(list(self.durable.record.fds)).read()
        assert payload is not None
        return decode(payload)

    def check(self, mail: Mail, *, remembered: bool = True) -> None:
        """What a restart would find right now holds everything the mail carries."""
        record = self.record()
        answers = {
            s["token"]: {rid: (a["reply"], a["handout"], a["grants"] + a["host_buffers"]) for rid, a in s["answers"].items()}
            for s in sessions(record)
        }
        fresh = {c["id"]: c["fresh"] for c in chunks(record)}
        for letter in mail.letters:
            reply = p.decode_reply(letter.frame)
            chunk_ids = [cid for b in letter.batches if b.owned for cid in b.ids]
            pool_ids = [pid for b in letter.batches if not b.owned for pid in b.ids]
            if reply.ok and remembered and letter.to in answers:
                assert answers[letter.to].get(reply.request_id) == (letter.frame, chunk_ids, pool_ids), (
                    f"request {reply.request_id}'s answer left before the record held it"
                )
            for cid in chunk_ids:
                assert chunk_name(cid) in self.store.held, f"chunk {cid} left before the store held it"
                assert fresh.get(cid) is False, f"chunk {cid} left while the record calls it fresh (a restart would zero it again)"
            for pid in pool_ids:  # a graph pool's lease segment, or a sleep buffer
                held = lease_name(pid) in self.store.held or host_buffer_name(pid) in self.store.held
                assert held, f"descriptor {pid} (a lease segment or host buffer) left before the store held it"

    def written(self) -> int:
        return self.durable.record.sequence


@pytest.fixture
def door(make_harness: Callable[..., Harness]) -> Iterator[Door]:
    h = make_harness()
    store = FakeStore()
    durable = Durable(store)  # type: ignore[arg-type]
    durable.start(h.state, {})
    mails: list[Mail] = []
    outbox = Outbox(h.state, durable)
    real = outbox.request

    def kept(to: bytes, session: SessionRecord | None, frame: bytes | memoryview) -> Mail | bytes:
        out = real(to, session, frame)
        mails.append(as_mail(to, out))
        return out

    outbox.request = kept  # type: ignore[method-assign]
    yield Door(h, store, durable, outbox)
    for mail in mails:  # the server would have sent and closed them
        for letter in mail.letters:
            for batch in letter.batches:
                if batch.owned:
                    fdchannel.close_all(batch.fds)
    h.state.drop_all()
    durable.close()
    store.drop()


def test_nothing_leaves_before_the_record_holds_it(door: Door) -> None:
    owner, peer = door.hello("owner"), door.hello("peer")
    door.send(owner, p.CreateArena(name="a", reserve_bytes=256 * MiB))
    _, mail = door.send(owner, p.CommitArena(name="a", nbytes=40 * MiB))
    assert [b.ids for b in mail.letters[0].batches], "the commit hands out chunks"
    token = door.send(owner, p.ShareArena(name="a", client="peer"))[1].letters[0].frame
    assert p.decode_reply(token).ok
    _, mail = door.send(peer, p.AttachArena(name="a"))
    assert mail.letters[0].batches, "the attach hands the same chunks to the peer"
    _, mail = door.send(owner, p.RegisterGraphPool(arena="a", label="g", extents=[p.Extent(offset=0, size=8 * MiB)], free_runs=[], shared=True))
    assert [b for b in mail.letters[0].batches if not b.owned], "the registration grants the lease segment"
    door.send(owner, p.KvDeclare(name="kv", buffers=[p.KvBuffer(name="k", row_bytes=4096)], max_tokens=4096))
    door.send(owner, p.RoundJoin(pool="kv"))
    # Deferred: the round commits within the report, and its answer leaves in the same mail.
    _, mail = door.send(owner, p.CaptureDone(pool="kv", min_tokens=16))
    assert len(mail.letters) == 1 and mail.letters[0].batches, "the round's answer and its chunks"


def test_a_read_only_request_writes_no_record_and_a_request_writes_it_once(door: Door) -> None:
    owner = door.hello("owner")
    before = door.written()
    for message in (p.Ping(), p.Status(), p.Ping()):
        door.send(owner, message)
    assert door.written() == before, "a read-only request wrote the record"
    door.send(owner, p.CreateArena(name="a", reserve_bytes=256 * MiB))
    door.send(owner, p.KvDeclare(name="kv", buffers=[p.KvBuffer(name="k", row_bytes=4096)], max_tokens=4096))
    door.send(owner, p.RoundJoin(pool="kv"))
    before = door.written()
    door.send(owner, p.CaptureDone(pool="kv", min_tokens=16))  # the request and the round's answer
    assert door.written() == before + 1


def test_a_reply_that_leaves_alone_leaves_after_the_record(door: Door) -> None:
    """Most replies go to the server as a bare frame (no Mail): the record is written
    before that frame is handed over all the same."""
    owner = door.hello("owner")
    before = door.written()
    out = door.outbox.request(owner.token, owner, p.encode_request(50, p.CreateArena(name="a", reserve_bytes=256 * MiB)))
    assert isinstance(out, bytes), "a reply with nothing to go with it was put in a Mail"
    assert door.written() == before + 1, "the bare reply was handed over before the record was written"
    door.check(as_mail(owner.token, out))
    assert isinstance(door.outbox.request(owner.token, owner, p.encode_request(51, p.Ping())), bytes)
    assert door.written() == before + 1


def test_a_resent_request_gets_its_recorded_answer_again(door: Door) -> None:
    owner = door.hello("owner")
    door.send(owner, p.CreateArena(name="a", reserve_bytes=256 * MiB))
    rid, first = door.send(owner, p.CommitArena(name="a", nbytes=40 * MiB))
    committed = door.h.state.arenas.by_name["a"].committed
    handed = [cid for b in first.letters[0].batches for cid in b.ids]
    # As a RESUME leaves it when the reply never reached the client: it maps none of them.
    owner.resending = {rid}
    door.h.state.arenas.drop_holder(owner.id, set(handed))
    door.durable.persist(door.h.state)
    _, again = door.send(owner, p.CommitArena(name="a", nbytes=40 * MiB), rid)
    assert again.letters[0].frame == first.letters[0].frame
    assert [b.ids for b in again.letters[0].batches] == [b.ids for b in first.letters[0].batches]
    assert door.h.state.arenas.by_name["a"].committed == committed, "carried out twice"
    holders = {c["id"]: c["holders"] for c in chunks(door.record())}
    assert all(owner.id in holders[cid] for cid in handed), "chunks handed out again before the record says who maps them"


def test_a_resent_sleep_buffer_request_hands_the_buffer_not_a_pool_of_its_id(door: Door) -> None:
    """A kept answer names its host buffer apart from graph pools: the buffer goes out
    again, never the lease segment of the pool that shares its id, and the request is
    not carried out twice (a resend under its id that asks for more gets no second buffer)."""
    owner = door.hello("owner")
    door.send(owner, p.CreateArena(name="a", reserve_bytes=256 * MiB))
    door.send(owner, p.CommitArena(name="a", nbytes=16 * MiB))
    _, mail = door.send(owner, p.RegisterGraphPool(arena="a", label="g", extents=[p.Extent(offset=0, size=8 * MiB)], free_runs=[]))
    rid, first = door.send(owner, p.SleepBuffer(arena="a", nbytes=8 * MiB))
    buffer = door.h.state.sleepers.buffers["a"]
    assert buffer.id in door.h.state.graph_pools.by_id, "a graph pool shares the buffer's id"
    assert [(b.ids, b.fds) for b in first.letters[0].batches] == [([buffer.id], [buffer.fd])]
    owner.resending = {rid}
    door.durable.persist(door.h.state)
    _, again = door.send(owner, p.SleepBuffer(arena="a", nbytes=16 * MiB), rid)
    assert again.letters[0].frame == first.letters[0].frame, "answered from the record, byte for byte"
    assert [(b.ids, b.fds) for b in again.letters[0].batches] == [([buffer.id], [buffer.fd])]
    assert door.h.state.sleepers.buffers["a"] is buffer and door.h.state.sleepers.host_bytes() == 8 * MiB, "a second buffer"


class RecordingDriver(HostDriver):
    """The host driver, recording each chunk export's zero flag; what a chunk held before
    its first handout is written into it first, as an earlier tenant's bytes would be."""

    def __init__(self) -> None:
        super().__init__(index=0, capacity=CAPACITY)
        self.exports: list[tuple[int, bool]] = []  # (chunk fd, fresh)

    def create_chunks(self, placements: list[tuple[int, int]]) -> list[Handle]:
        handles = super().create_chunks(placements)
        for fd in handles:
            os.pwrite(fd, b"\xab" * 4096, 0)
        return handles

    def export_fds(self, chunks: list[tuple[int, int, Handle, bool]]) -> list[int]:
        self.exports += [(handle, fresh) for _, _, handle, fresh in chunks]
        return super().export_fds(chunks)


def test_a_chunk_is_zeroed_before_its_first_tenant_and_only_then(make_harness: Callable[..., Harness]) -> None:
    driver = RecordingDriver()
    h = make_harness(driver=driver)
    outbox = Outbox(h.state, None)
    owner, peer = h.connect("owner"), h.connect("peer")
    sent: list[int] = []

    def send(session: SessionRecord, message: p.RequestMessage) -> list[int]:
        mail = as_mail(session.token, outbox.request(session.token, session, p.encode_request(len(sent) + 1, message)))
        assert all(p.decode_reply(letter.frame).ok for letter in mail.letters)
        fds = [fd for letter in mail.letters for b in letter.batches if b.owned for fd in b.fds]
        sent.extend(fds)
        return fds

    try:
        send(owner, p.CreateArena(name="a", reserve_bytes=256 * MiB))
        first = send(owner, p.CommitArena(name="a", nbytes=40 * MiB))
        assert first and [fresh for _, fresh in driver.exports] == [True] * len(first), "a new chunk left unzeroed"
        assert all(os.pread(fd, 4096, 0) == bytes(4096) for fd in first), "the first tenant read what was there before"
        os.pwrite(first[0], b"owner's", 0)
        driver.exports.clear()
        send(owner, p.ShareArena(name="a", client="peer"))
        again = send(peer, p.AttachArena(name="a"))
        assert again and [fresh for _, fresh in driver.exports] == [False] * len(again), "a chunk in use was zeroed again"
        assert os.pread(again[0], 7, 0) == b"owner's", "the sharer does not see the owner's bytes"
    finally:
        fdchannel.close_all(sent)


def test_a_staged_kv_minimum_is_zeroed_when_staged_and_not_again_at_handout(make_harness: Callable[..., Harness]) -> None:
    driver = RecordingDriver()
    h = make_harness(driver=driver)
    outbox = Outbox(h.state, None)
    a, b = h.connect("engine-a"), h.connect("engine-b")
    sent: list[int] = []
    next_id = iter(range(1, 100))

    def send(session: SessionRecord, message: p.RequestMessage) -> dict[bytes, list[int]]:
        mail = as_mail(session.token, outbox.request(session.token, session, p.encode_request(next(next_id), message)))
        assert all(p.decode_reply(letter.frame).ok for letter in mail.letters)
        fds = {letter.to: [fd for batch in letter.batches if batch.owned for fd in batch.fds] for letter in mail.letters}
        sent.extend(fd for got in fds.values() for fd in got)
        return fds

    try:
        for session, pool in ((a, "kva"), (b, "kvb")):
            send(session, p.KvDeclare(name=pool, buffers=[p.KvBuffer(name="k", row_bytes=4096)], max_tokens=8192))
            send(session, p.RoundJoin(pool=pool, expect=2))
        assert send(a, p.CaptureDone(pool="kva", min_tokens=8192)) == {}, "the round waits for engine-b"
        driver.exports.clear()
        handed = send(b, p.CaptureDone(pool="kvb", min_tokens=16))[a.token]
        fresh = {os.fstat(handle).st_ino: flag for handle, flag in driver.exports}
        staged = [fresh[os.fstat(fd).st_ino] for fd in handed]
        assert handed and staged == [False] * len(handed), "the staged minimum was zeroed again at handout (or never staged)"
        assert all(os.pread(fd, 4096, 0) == bytes(4096) for fd in handed), "engine-a read what its chunks held before"
    finally:
        fdchannel.close_all(sent)
