"""The fence's /proc half with real processes: a process killed with -9 counts as gone
only once its descriptors are closed, whichever of its threads exits last (a zombie
leader whose other threads still exit is not gone), and a live one never does."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time

from gpumemd.fencing import host_fence, process_gone

# Threads that spin in Python: SIGKILL finds them running, and they exit after the leader.
_SPINNERS = r"""
import threading, time
def spin():
    while True:
        pass
for _ in range(6):
    threading.Thread(target=spin, daemon=True).start()
print("GO", flush=True)
time.sleep(120)
"""


def test_a_killed_process_is_gone_only_once_its_descriptors_are_closed() -> None:
    for _ in range(5):
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen([sys.executable, "-c", _SPINNERS], stdout=subprocess.PIPE, pass_fds=[theirs.fileno()])
        theirs.close()
        try:
            assert proc.stdout is not None and proc.stdout.readline() == b"GO\n"
            since = time.time() - 1
            assert not process_gone(proc.pid, since) and host_fence(proc.pid, since) == f"pid {proc.pid} still runs"
            os.kill(proc.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while not process_gone(proc.pid, since):
                assert time.monotonic() < deadline, "a killed process never counted as gone"
            # Gone means its descriptors are closed: the socket it held is at EOF now.
            assert select.select([ours], [], [], 0)[0] and ours.recv(1) == b""
            assert host_fence(proc.pid, since) == ""
        finally:
            proc.kill()
            proc.wait()
            ours.close()
            if proc.stdout is not None:
                proc.stdout.close()


def test_a_reused_pid_is_not_the_process_that_said_hello() -> None:
    assert process_gone(os.getpid(), time.time() - 3600)  # "said HELLO" an hour before this process started
    assert not process_gone(os.getpid(), time.time())
