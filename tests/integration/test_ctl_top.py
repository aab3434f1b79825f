"""``gpumemctl top`` against a host daemon with two clients: ``--once`` as a plain frame
for scripts, the live view redrawn in place on a terminal, and what moved between
two frames."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conftest import child_env
from gpumem.ctl import render_top
from gpumem_shared import protocol as p
from gpumemd_testkit import GiB, MiB, do, status


def two_clients(run_client: Any) -> tuple[Any, Any]:
    """engine-a owns kv (64 MiB) with a graph pool whose capture lease it holds;
    engine-b attached kv and owns scratch (6 MiB)."""
    a, b = run_client("shell", "engine-a"), run_client("shell", "engine-b")
    a.expect("CONNECTED")
    b.expect("CONNECTED")
    do(a, f"create kv {GiB}")
    do(a, f"commit kv {64 * MiB}")
    do(a, "share kv engine-b")
    do(b, "attach kv")
    do(b, f"create scratch {GiB}")
    do(b, f"commit scratch {6 * MiB}")
    pool = json.loads(do(a, f"gpregister kv decode 0 {4 * MiB}"))
    do(a, f"lease capture {pool['id']} 0 recapture")
    return a, b


def rows(out: str, section: str) -> list[list[str]]:
    """The rows of a section's table, split on runs of two spaces or more."""
    block = out.split(f"\n{section}\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return [re.split(r"\s{2,}", line.strip()) for line in block[1:]]


def test_once_prints_one_plain_frame(daemon, run_client, runtime_dir: Path) -> None:  # type: ignore[no-untyped-def]
    a, b = two_clients(run_client)
    result = subprocess.run(
        [sys.executable, "-m", "gpumem.ctl", "top", "--once"], capture_output=True, text=True, timeout=30, env=child_env(runtime_dir)
    )
    assert result.returncode == 0 and result.stderr == "", result
    out = result.stdout
    assert "\x1b" not in out, "a frame for scripts has no terminal codes"
    s = status(runtime_dir)
    assert out.startswith(f"gpumemd {s['daemon']['version']}  device 0: {s['device']['name']}  {daemon.backend}  serving")
    assert "held by gpumemd 70 MiB" in out and "2 clients  2 arenas  1 graph pools  1 leases held  0 KV rounds active" in out
    session = {c["name"]: str(c["session_id"]) for c in s["clients"]}
    assert rows(out, "CLIENTS") == [  # the largest first
        ["engine-a", str(a.pid), session["engine-a"], "64 MiB", "kv"],
        ["engine-b", str(b.pid), session["engine-b"], "6 MiB", "kv,scratch"],
    ]
    assert rows(out, "ARENAS") == [
        ["kv", "engine-a", "64 MiB", "1 GiB", "6%", "1", "engine-a,engine-b", "-"],
        ["scratch", "engine-b", "6 MiB", "1 GiB", "1%", "2", "engine-b", "-"],
    ]
    ((pool, arena, kind, holder, pid, label, held_for),) = rows(out, "LEASES")
    assert (pool, arena, kind, holder, pid, label) == (f"decode ({s['graph_pools'][0]['id']})", "kv", "capture", "engine-a", str(a.pid), "recapture")
    assert re.fullmatch(r"\d+ms|\d+m\d+s", held_for), held_for
    assert "ROUNDS\n  (none)" in out


def test_a_frame_shows_what_each_client_committed_since_the_last(daemon, run_client, runtime_dir: Path) -> None:  # type: ignore[no-untyped-def]
    a, b = two_clients(run_client)
    before = p.from_wire(p.StatusReply, status(runtime_dir))
    do(a, f"commit kv {128 * MiB}")
    do(b, "decommit scratch 0")
    after = p.from_wire(p.StatusReply, status(runtime_dir))
    frame = "\n".join(render_top(after, before, time.time()))
    changes = {row[0]: row[4] for row in rows(frame, "CLIENTS")}
    assert changes == {"engine-a": "+64 MiB", "engine-b": "-6 MiB"}, frame
    unchanged = "\n".join(render_top(after, after, time.time()))
    assert [len(row) for row in rows(unchanged, "CLIENTS")] == [5, 5], "no change, no figure"


def test_live_on_a_terminal_redraws_in_place(daemon, run_client, runtime_dir: Path) -> None:  # type: ignore[no-untyped-def]
    two_clients(run_client)
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpumem.ctl", "top", "--count", "3", "--interval", "0.1"],
        stdout=follower,
        stderr=follower,
        env=child_env(runtime_dir),
    )
    os.close(follower)
    out = b""
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], max(0.0, deadline - time.monotonic()))
            try:
                chunk = os.read(leader, 65536) if ready else b""
            except OSError:  # EIO: the other end closed
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=10) == 0, out
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
    text = out.decode()
    assert text.startswith("\x1b[?25l") and text.rstrip().endswith("\x1b[?25h"), "the cursor is hidden while drawing, then back"
    assert text.count("\x1b[H") == 3, "each frame starts at the top of the screen"
    assert text.count("\x1b[J") == 3, "and clears what the frame before left below it"
    assert text.count("engine-a") >= 3
