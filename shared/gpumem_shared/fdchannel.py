"""Framing on the AF_UNIX SOCK_SEQPACKET fd channel.

SEQPACKET keeps message boundaries, so descriptors (SCM_RIGHTS) arrive attached to
exactly the message they were sent with, and SO_PEERCRED names the peer. Every
received descriptor is either handed to the caller or closed here: a descriptor
nobody owns pins a chunk of device memory.
"""

from __future__ import annotations

import os
import socket
import struct

from gpumem_shared.protocol import MAX_FDS_PER_MESSAGE, MAX_FRAME_BYTES, ErrorCode, ProtocolError

RECV_BUFFER = 1 << 16


def send(sock: socket.socket, payload: bytes, fds: list[int] | None = None) -> None:
    if fds:
        if len(fds) > MAX_FDS_PER_MESSAGE:
            raise ValueError(f"{len(fds)} fds in one message; the kernel takes at most {MAX_FDS_PER_MESSAGE}")
        socket.send_fds(sock, [payload], fds)
    else:
        sock.send(payload)


def recv(sock: socket.socket, max_fds: int = MAX_FDS_PER_MESSAGE) -> tuple[bytes, list[int]]:
    """One message and its descriptors. Returns (b"", []) at EOF."""
    payload, fds, flags, _ = socket.recv_fds(sock, RECV_BUFFER, max_fds)
    if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        for fd in fds:
            os.close(fd)
        what = "descriptors" if flags & socket.MSG_CTRUNC else "bytes"
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"fd-channel message truncated (too many {what})")
    if len(payload) > MAX_FRAME_BYTES:
        for fd in fds:
            os.close(fd)
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "fd-channel message too large")
    return payload, fds


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer, as the kernel recorded them at connect."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
