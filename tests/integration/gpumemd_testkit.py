"""Raw-wire helpers for the integration tests: no gpumem client library in the way.

- ``RawControl``: a ZeroMQ DEALER on a daemon's control channel, anonymous or bound
  to a session by the token a raw HELLO returned; sends whatever frames it is given.
- ``RawSession``: an fd-channel connection that said HELLO itself, plus its
  token-bound DEALER; takes (and closes) the descriptors the daemon hands it.
- ``status`` / ``wait_status`` / ``ping``: the daemon's view, through the library's
  ControlChannel, as plain dicts; ``Probe``: what its process holds, from /proc.

Every wait is bounded; every socket and descriptor is closed by ``close``.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

from gpumem.control import ControlChannel
from gpumem_shared import protocol as p
from gpumem_shared.paths import Endpoints

MiB = 1 << 20
GiB = 1 << 30
GRANULARITY = 2 * MiB  # host backend's granule, and every current NVIDIA GPU's


def envelope(msg_type: Any, body: Any = None, request_id: Any = 1, version: Any = None, **extra: Any) -> bytes:
    data: dict[str, Any] = {"v": list(p.PROTOCOL_VERSION) if version is None else version, "id": request_id, "t": msg_type}
    data["b"] = {} if body is None else body
    data.update(extra)
    return msgpack.packb(data, use_bin_type=True)


def decode(frame: bytes) -> dict[str, Any]:
    data = msgpack.unpackb(frame, raw=False)
    assert isinstance(data, dict), f"reply is not a map: {data!r}"
    assert data.get("v") == list(p.PROTOCOL_VERSION), data
    return data


def assert_error(reply: dict[str, Any], code: p.ErrorCode, request_id: int | None = None) -> dict[str, Any]:
    assert reply["ok"] is False, f"expected {code.name}, got success: {reply}"
    assert reply["code"] == int(code), f"expected {code.name}, got {p.ErrorCode(reply['code']).name}: {reply['msg']}"
    assert isinstance(reply["msg"], str) and reply["msg"], reply
    assert isinstance(reply["detail"], dict), reply
    if request_id is not None:
        assert reply["id"] == request_id, reply
    return reply


def status(runtime_dir: Path, device: int = 0, timeout: float = 5.0) -> dict[str, Any]:
    channel = ControlChannel(Endpoints(runtime_dir, device))
    try:
        return p.to_wire(channel.call(p.Status(), timeout))  # type: ignore[no-any-return]
    finally:
        channel.close()


def ping(runtime_dir: Path, device: int = 0, timeout: float = 5.0) -> None:
    channel = ControlChannel(Endpoints(runtime_dir, device))
    try:
        channel.call(p.Ping(), timeout)
    finally:
        channel.close()


def wait_status(
    runtime_dir: Path, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str, device: int = 0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        s = status(runtime_dir, device)
        if predicate(s):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within {timeout}s; last status {s}")
        time.sleep(0.01)


def accounting(s: dict[str, Any]) -> dict[str, Any]:
    """What a refused request must leave exactly as it was."""
    return {"accounted_bytes": s["device"]["accounted_bytes"], "arenas": s["arenas"], "clients": s["clients"]}


class RawControl:
    """A DEALER on the control channel; ``routing_id`` binds it to a session."""

    def __init__(self, runtime_dir: Path, routing_id: bytes | None = None, device: int = 0) -> None:
        self.sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        self.sock.connect(Endpoints(runtime_dir, device).zmq_url)

    def send_frames(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout: float = 5.0) -> dict[str, Any]:
        if not self.sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise AssertionError(f"no reply on the control channel within {timeout}s")
        frames = self.sock.recv_multipart()
        assert len(frames) == 1, f"a reply is exactly one frame, got {len(frames)}"
        return decode(frames[0])

    def raw(self, *frames: bytes, timeout: float = 5.0) -> dict[str, Any]:
        self.send_frames(*frames)
        return self.recv(timeout)

    def call(self, msg_type: Any, body: Any = None, request_id: Any = 1, **kw: Any) -> dict[str, Any]:
        return self.raw(envelope(msg_type, body, request_id, **kw))

    def close(self) -> None:
        self.sock.close(linger=0)

    def __enter__(self) -> RawControl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fd_connect(runtime_dir: Path, device: int = 0, timeout: float = 5.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        sock.connect(str(Endpoints(runtime_dir, device).fd_path))
    except BaseException:
        sock.close()
        raise
    return sock


def fd_recv(sock: socket.socket, timeout: float = 5.0) -> tuple[bytes, list[int]]:
    """One fd-channel message (b"" at EOF) and its descriptors (the caller closes them)."""
    sock.settimeout(timeout)
    payload, fds, _flags, _ = socket.recv_fds(sock, 1 << 16, p.MAX_FDS_PER_MESSAGE)
    return payload, fds


class RawSession:
    """A session opened by hand: HELLO on the fd channel, the token as routing id."""

    def __init__(self, runtime_dir: Path, name: str, device: int = 0) -> None:
        self.fd_sock = fd_connect(runtime_dir, device)
        self.control: RawControl | None = None
        try:
            self.fd_sock.send(envelope(p.MsgType.HELLO, {"name": name, "client_version": "raw"}, 1))
            payload, fds = fd_recv(self.fd_sock)
            os_close_all(fds)
            reply = decode(payload)
            assert reply["ok"] is True, reply
            self.hello = reply["b"]
            self.token: bytes = self.hello["token"]
            self.session_id: int = self.hello["session_id"]
            self.control = RawControl(runtime_dir, routing_id=self.token, device=device)
        except BaseException:
            self.close()
            raise
        self._ids = iter(range(100, 1 << 30))

    def call(self, msg_type: Any, body: Any = None, request_id: int | None = None, **kw: Any) -> dict[str, Any]:
        """One request; descriptors that come with a successful map reply are taken and closed."""
        assert self.control is not None
        rid = next(self._ids) if request_id is None else request_id
        reply = self.control.call(msg_type, body, rid, **kw)
        if reply["ok"] and isinstance(reply["b"], dict) and reply["b"].get("fd_batches"):
            for _ in range(reply["b"]["fd_batches"]):
                payload, fds = fd_recv(self.fd_sock)
                os_close_all(fds)
                event = decode(payload)
                assert event["t"] == p.MsgType.FD_BATCH and event["b"]["request_id"] == rid, event
                assert len(fds) == len(event["b"]["chunk_ids"]), event
        return reply

    def create(self, name: str, reserve: int) -> dict[str, Any]:
        reply = self.call(p.MsgType.ARENA_CREATE, {"name": name, "reserve_bytes": reserve})
        assert reply["ok"], reply
        return reply

    def commit(self, name: str, nbytes: int) -> dict[str, Any]:
        return self.call(p.MsgType.ARENA_COMMIT, {"name": name, "nbytes": nbytes})

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None
        self.fd_sock.close()

    def __enter__(self) -> RawSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Probe:
    """A process as /proc shows it: alive or not, resident memory, open descriptors, CPU time."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0] != "Z"
        except FileNotFoundError:
            return False

    def rss(self) -> int:
        return self._status_bytes("VmRSS")

    def peak_rss(self) -> int:
        return self._status_bytes("VmHWM")

    def _status_bytes(self, field: str) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError(f"no {field} for pid {self.pid}")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def descriptors(self) -> set[str]:
        """Its descriptors as "fd -> what". Compare sets, not counts: ZeroMQ closes a
        closed socket's connection on its own thread, a moment later, so a count taken
        meanwhile may drop by itself; a new entry is a descriptor that came."""
        found = set()
        for fd in os.listdir(f"/proc/{self.pid}/fd"):
            try:
                found.add(f"{fd} -> {os.readlink(f'/proc/{self.pid}/fd/{fd}')}")
            except FileNotFoundError:  # closed meanwhile (listdir's own, in this process)
                continue
        return found

    def cpu_seconds(self) -> float:
        """User and system time the process has used so far."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def os_close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def readable(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def reply(client: Any, command: str, timeout: float = 30.0) -> str:
    """Send one command to a tests/clients.py shell; its one answer line, whatever it is."""
    client.send(command)
    return str(client.expect("", timeout))


def do(client: Any, command: str, timeout: float = 30.0) -> str:
    """One command that must succeed; returns its result."""
    line = reply(client, command, timeout)
    assert line == "OK" or line.startswith("OK "), f"{command!r} answered {line!r}"
    return line[3:]


def read_line(proc: subprocess.Popen[str], prefix: str, timeout: float = 30.0) -> str:
    """The rest of the first line ``proc`` prints that starts with ``prefix``; fails, with
    its stderr, if it exits first or prints none within ``timeout``."""
    try:
        line = lines_until(proc, lambda text: text.startswith(prefix), f"{proc.args!r} printing {prefix!r}", timeout)[-1]
    except AssertionError as e:
        err = proc.stderr.read() if proc.stderr is not None and proc.poll() is not None else ""
        raise AssertionError(f"{e}\n{err}") from None
    return line[len(prefix) :].strip()


def lines_until(proc: subprocess.Popen[str], found: Callable[[str], bool], what: str, timeout: float = 240.0) -> list[str]:
    """The lines ``proc`` prints (stderr merged) up to the first one ``found`` accepts; fails
    with the last of them if it exits or prints none within ``timeout`` (an engine or a
    server starting: a model built, graphs captured). Read on a thread that stops at that
    line, leaving the rest to the caller: a selector on the pipe would not see lines
    already in the text wrapper's buffer (a server printing several at once), and waits
    out the timeout while the one asked for sits there."""
    assert proc.stdout is not None
    stdout, seen, done = proc.stdout, [], threading.Event()

    def read() -> None:
        for line in iter(stdout.readline, ""):
            seen.append(line)
            if found(line):
                break
        done.set()

    threading.Thread(target=read, name=f"lines-until-{proc.pid}", daemon=True).start()
    if done.wait(timeout) and seen and found(seen[-1]):
        return seen
    raise AssertionError(f"{what}: not within {timeout}s (exit {proc.poll()}):\n{''.join(seen)[-6000:]}")


def wait_json(path: Path, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> dict[str, object]:
    """The JSON a process writes to ``path`` once it gets there (an engine's milestone),
    waited for up to ``timeout`` seconds; fails early, with its log, if it exits first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the engine exited ({proc.returncode}) before {path.name}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {path.name} within {timeout}s:\n{log.read_text()}"
        time.sleep(0.05)
    data: dict[str, object] = json.loads(path.read_text())
    return data
