"""Read-only grants on the state: a session that only read-only grants admit is a reader
of the arena (its replies say so, and the outbox hands it read-only descriptors); one
that any read-write grant admits maps read-write; leaving the arena forgets it."""

from __future__ import annotations

from gpumem_shared import protocol as p

from .harness import Harness, MiB


def test_only_read_only_grants_make_a_reader(h: Harness) -> None:
    owner = h.connect("owner")
    h.create(owner, "weights", 64 * MiB)
    h.commit(owner, "weights", 8 * MiB)
    token = h.ok(owner, p.ShareArena(name="weights", client="standby", read_only=True)).reply.token
    standby, writer = h.connect("standby"), h.connect("writer")
    reply = h.attach(standby, "weights").reply
    assert isinstance(reply, p.MapReply) and reply.read_only and reply.chunks
    arena = h.state.arenas.by_name["weights"]
    assert arena.readers == {standby.id}
    assert h.state.arenas.read_only_for(standby.id, "weights") and not h.state.arenas.read_only_for(owner.id, "weights")
    assert [g.read_only for g in h.state.status().arenas[0].grants] == [True]
    # A read-write grant that admits it too wins.
    h.ok(owner, p.ShareArena(name="weights", client="writer"))
    h.ok(owner, p.ShareArena(name="weights", client="writer", read_only=True))
    assert not h.attach(writer, "weights").reply.read_only and writer.id not in arena.readers
    h.release(standby, "weights")
    assert arena.readers == set()
    assert h.attach(standby, "weights", token).reply.read_only  # by its token too
