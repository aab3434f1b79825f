"""Misuse of the fd channel (AF_UNIX SOCK_SEQPACKET): silent peers are dropped after
--hello-timeout, descriptors sent to the daemon are refused and closed, the first
message must be a HELLO of our protocol major."""

from __future__ import annotations

import os
import socket
import threading
import time

import msgpack
import pytest

from gpumem_shared import protocol as p
from gpumemd_testkit import (
    Probe,
    RawSession,
    accounting,
    assert_error,
    decode,
    envelope,
    fd_connect,
    fd_recv,
    ping,
    readable,
    status,
    wait_status,
)

E = p.ErrorCode
T = p.MsgType
HELLO_TIMEOUT = 0.5


def _hello(name: str, request_id: int = 1, version: object = None) -> bytes:
    return envelope(T.HELLO, {"name": name, "client_version": "raw"}, request_id, version=version)


def test_silent_peer_is_dropped_after_hello_timeout(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory("host", args=["--hello-timeout", str(HELLO_TIMEOUT)])
    with RawSession(runtime_dir, "talker") as talker:
        started = time.monotonic()
        silent = fd_connect(runtime_dir)
        try:
            payload, fds = fd_recv(silent, timeout=5.0)  # blocks until the daemon hangs up
            elapsed = time.monotonic() - started
            assert (payload, fds) == (b"", []), "expected EOF on a peer that never said HELLO"
            assert HELLO_TIMEOUT * 0.9 <= elapsed < HELLO_TIMEOUT + 1.5, elapsed
        finally:
            silent.close()
        # A peer that did say HELLO in time is not touched, well past the timeout.
        time.sleep(HELLO_TIMEOUT)
        assert [c["name"] for c in status(runtime_dir)["clients"]] == ["talker"]
        assert talker.call(T.PING)["ok"]
        talker.fd_sock.setblocking(False)
        try:
            talker.fd_sock.recv(1)
            raise AssertionError("the daemon sent something to (or closed) a session that did nothing wrong")
        except BlockingIOError:
            pass
    assert "sent no HELLO" in daemon.log()
    ping(runtime_dir)


def test_descriptors_sent_to_the_daemon_are_refused_and_closed(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon_factory("host")
    before = status(runtime_dir)
    sock = fd_connect(runtime_dir)
    r, w = os.pipe()
    try:
        # A perfectly good HELLO, but with two descriptors riding along.
        r2, w2 = os.pipe()
        socket.send_fds(sock, [_hello("fd-pusher", 5)], [w, w2])
        os.close(w2)
        payload, fds = fd_recv(sock)
        assert fds == []
        reply = assert_error(decode(payload), E.UNEXPECTED_FDS, request_id=5)  # refused under its own id
        assert "2" in reply["msg"], reply
        # The daemon closed its copies: with ours closed too, the read ends see EOF.
        os.close(w)
        w = -1
        for end in (r, r2):
            assert readable(end, 5.0), "pipe still has a writer: the daemon kept the descriptor"
            assert os.read(end, 1) == b""
        os.close(r2)
        # The refused HELLO opened no session.
        assert accounting(status(runtime_dir)) == accounting(before)
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)
        sock.close()
    ping(runtime_dir)


def test_descriptors_after_hello_are_refused_and_session_survives(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon_factory("host")
    with RawSession(runtime_dir, "later-pusher") as s:
        s.create("kv", 1 << 30)
        assert s.commit("kv", 4 << 20)["ok"]
        before = status(runtime_dir)
        r, w = os.pipe()
        try:
            socket.send_fds(s.fd_sock, [envelope(T.PING, None, 9)], [w])
            os.close(w)
            w = -1
            payload, fds = fd_recv(s.fd_sock)
            assert fds == []
            assert_error(decode(payload), E.UNEXPECTED_FDS, request_id=9)
            assert readable(r, 5.0) and os.read(r, 1) == b""
        finally:
            for fd in (r, w):
                if fd >= 0:
                    os.close(fd)
        assert accounting(status(runtime_dir)) == accounting(before)
        assert s.call(T.PING)["ok"]
        # Requests after HELLO belong on the control channel.
        s.fd_sock.send(envelope(T.STATUS, None, 10))
        payload, _ = fd_recv(s.fd_sock)
        assert_error(decode(payload), E.UNKNOWN_MESSAGE, request_id=10)


def test_first_message_must_be_hello(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon_factory("host")
    before = status(runtime_dir)
    for request_id, frame, code in [
        (7, envelope(T.PING, None, 7), E.NO_SESSION),
        (8, envelope(T.ARENA_CREATE, {"name": "x", "reserve_bytes": 2 << 20}, 8), E.NO_SESSION),
        (9, envelope(T.STATUS, None, 9), E.NO_SESSION),
        (0, b"\xc1garbage", E.BAD_MESSAGE),
        (0, msgpack.packb([1, 2, 3]), E.BAD_MESSAGE),
        (12, envelope(T.HELLO, {"client_version": "x"}, 12), E.INVALID_ARGUMENT),  # no name
        (13, _hello("bad name!", 13), E.INVALID_ARGUMENT),
        (14, envelope(4242, None, 14), E.UNKNOWN_MESSAGE),
    ]:
        with fd_connect(runtime_dir) as sock:
            sock.send(frame)
            payload, fds = fd_recv(sock)
            assert fds == []
            assert_error(decode(payload), code, request_id=request_id)
            # The same connection may still open a session properly.
            sock.send(_hello(f"retry-{request_id}", 20))
            ok = decode(fd_recv(sock)[0])
            assert ok["ok"] is True and ok["id"] == 20, ok
    # Every retry's session ended with its connection; nothing else was opened.
    wait_status(runtime_dir, lambda st: accounting(st) == accounting(before), 2.0, "sessions closed")


def test_hello_with_other_protocol_major_is_refused(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon_factory("host")
    before = status(runtime_dir)
    major, minor = p.PROTOCOL_VERSION
    with fd_connect(runtime_dir) as sock:
        sock.send(_hello("from-the-future", 3, version=[major + 1, 0]))
        reply = assert_error(decode(fd_recv(sock)[0]), E.PROTOCOL_MISMATCH, request_id=3)
        assert reply["detail"] == {"peer": f"{major + 1}.0", "ours": f"{major}.{minor}"}, reply
        assert "upgrade" in reply["msg"], reply
        assert accounting(status(runtime_dir)) == accounting(before)
        # A newer minor of the same major is welcome.
        sock.send(_hello("from-a-newer-minor", 4, version=[major, minor + 5]))
        ok = decode(fd_recv(sock)[0])
        assert ok["ok"] is True and ok["b"]["protocol"] == [major, minor], ok
        assert [c["name"] for c in status(runtime_dir)["clients"]] == ["from-a-newer-minor"]


def test_hello_from_a_minor_older_than_lease_segments_is_refused(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """A 1.2 client expects the whole lease table with HELLO: it gets a clear refusal."""
    daemon_factory("host")
    before = status(runtime_dir)
    major, minor = p.PROTOCOL_VERSION
    with fd_connect(runtime_dir) as sock:
        sock.send(_hello("from-the-past", 6, version=[1, 2]))
        payload, fds = fd_recv(sock)
        assert fds == [], "nothing rides with HELLO"
        reply = assert_error(decode(payload), E.PROTOCOL_MISMATCH, request_id=6)
        assert reply["detail"] == {"peer": "1.2", "ours": f"{major}.{minor}"}, reply
        assert "1.3 or later" in reply["msg"] and "upgrade" in reply["msg"], reply
        assert accounting(status(runtime_dir)) == accounting(before)
        sock.send(_hello("now-current", 7))
        payload, fds = fd_recv(sock)
        ok = decode(payload)
        assert ok["ok"] is True and ok["b"]["lease_slots"] == 0 and fds == [], (ok, fds)


def test_a_client_refuses_a_daemon_older_than_lease_segments(runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """A 1.2 daemon hands every session the whole lease table with HELLO: the client
    refuses it, and keeps no descriptor of that table."""
    from gpumem.channel import SessionChannel
    from gpumem.errors import ProtocolMismatch
    from gpumem_shared.paths import Endpoints

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(runtime_dir / "gpu0.fd"))
    listener.listen(1)
    device = p.DeviceInfo(index=0, uuid="HOST-old", name="old", total_bytes=1 << 30, granularity=2 << 20)
    hello = p.HelloReply(
        protocol=[1, 2], daemon_version="old", daemon_pid=1, session_id=1, token=b"t" * 16, backend=p.Backend.HOST, device=device, lease_slots=1024
    )
    table = os.memfd_create("gpumemd-leases")
    os.ftruncate(table, 64 * 1024)

    def old_daemon() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(1 << 16)
            frame = {"v": [1, 2], "id": 1, "ok": True, "code": 0, "msg": "", "detail": {}, "b": p.to_wire(hello)}
            socket.send_fds(conn, [msgpack.packb(frame)], [table])
            conn.recv(1)  # until the client hangs up

    server = threading.Thread(target=old_daemon, daemon=True)
    server.start()
    try:
        held = Probe(os.getpid()).descriptors()
        with pytest.raises(ProtocolMismatch, match=r"peer speaks protocol 1\.2.*1\.3 or later"):
            SessionChannel(Endpoints(runtime_dir, 0), "new-client", 5.0)
        server.join(5.0)
        assert not server.is_alive(), "the client did not hang up"
        kept = Probe(os.getpid()).descriptors() - held
        assert not kept, f"the client kept the old daemon's table (or its socket): {kept}"
    finally:
        listener.close()
        os.close(table)


def test_a_client_with_a_tenant_token_refuses_a_daemon_that_would_ignore_it(runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """A 1.10 daemon decodes HELLO without its tenant token: the session would count
    against the uid's cap, not the token's. The client hangs up and says so."""
    from gpumem.channel import SessionChannel
    from gpumem.errors import ProtocolMismatch
    from gpumem_shared.paths import Endpoints

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(runtime_dir / "gpu0.fd"))
    listener.listen(1)
    device = p.DeviceInfo(index=0, uuid="HOST-old", name="old", total_bytes=1 << 30, granularity=2 << 20)
    hello = p.HelloReply(protocol=[1, 10], daemon_version="old", daemon_pid=1, session_id=1, token=b"t" * 16, backend=p.Backend.HOST, device=device)
    got: list[bytes] = []

    def old_daemon() -> None:
        conn, _ = listener.accept()
        with conn:
            got.append(conn.recv(1 << 16))
            conn.send(msgpack.packb({"v": [1, 10], "id": 1, "ok": True, "code": 0, "msg": "", "detail": {}, "b": p.to_wire(hello)}))
            conn.recv(1)  # until the client hangs up

    server = threading.Thread(target=old_daemon, daemon=True)
    server.start()
    try:
        with pytest.raises(ProtocolMismatch, match=r"speaks protocol 1\.10, which knows no tenant tokens") as info:
            SessionChannel(Endpoints(runtime_dir, 0), "pod-a", 5.0, tenant_token="s3cret-token-of-pod-a")
        assert "s3cret" not in str(info.value)
        server.join(5.0)
        assert not server.is_alive(), "the client did not hang up"
        assert b"s3cret-token-of-pod-a" in got[0], "the token went in HELLO"
    finally:
        listener.close()
