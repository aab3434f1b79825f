"""What gpumemd logs about a client's requests: at debug, one line per request with its
type, client, size, outcome and time; as JSON, one object per line, and the refusal
and the reclaim of a client that died carry their figures."""

from __future__ import annotations

import json
import re
import time
from typing import Any

from gpumemd_testkit import GiB, MiB, do

REQUEST = re.compile(r"request (\d+) (\w+) from client '([^']+)' \(session \d+\)(?:, (\w+) (\d+))?: (\w+) in (\d+) µs$")


def _lines_until(daemon: Any, done: Any, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while not done(lines := daemon.log().splitlines()):
        assert time.monotonic() < deadline, f"the daemon's log never got there:\n{daemon.log()}"
        time.sleep(0.05)
    return lines


def test_debug_logs_every_request_and_info_none(daemon_factory, run_client) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory("host", args=["--log-level", "debug"])
    client = run_client("shell", "engine-a")
    client.expect("CONNECTED")
    do(client, f"create kv {8 * GiB}")
    do(client, f"commit kv {6 * MiB}")
    assert json.loads(do(client, f"errinfo commit kv {6 * GiB}"))["error"] == "OutOfMemory"
    lines = _lines_until(daemon, lambda lines: sum("ARENA_COMMIT" in line for line in lines) == 2)
    requests = [m.groups() for line in lines if (m := REQUEST.search(line))]
    commits = [r for r in requests if r[1] == "ARENA_COMMIT"]
    assert [(r[2], r[3], int(r[4]), r[5]) for r in commits] == [
        ("engine-a", "nbytes", 6 * MiB, "ok"),
        ("engine-a", "nbytes", 6 * GiB, "OUT_OF_MEMORY"),
    ], lines
    assert ("engine-a", "reserve_bytes", str(8 * GiB), "ok") in [(r[2], r[3], r[4], r[5]) for r in requests if r[1] == "ARENA_CREATE"]

    quiet = daemon_factory("host", device=1)  # the default level: info
    other = run_client("shell", "engine-b", "1")
    other.expect("CONNECTED")
    do(other, f"create kv {8 * GiB}")
    do(other, f"commit kv {6 * MiB}")
    do(other, "ping")
    assert not [line for line in quiet.log().splitlines() if REQUEST.search(line)], quiet.log()


def test_json_lines_carry_the_figures_of_refusals_and_reclaims(daemon_factory, run_client) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory("host", args=["--log-format", "json"])
    client = run_client("shell", "engine-a")
    client.expect("CONNECTED")
    do(client, f"create kv {8 * GiB}")
    do(client, f"commit kv {6 * MiB}")
    assert json.loads(do(client, f"errinfo commit kv {6 * GiB}"))["error"] == "OutOfMemory"
    client.kill()  # still attached to its arena: the daemon reclaims it
    lines = _lines_until(daemon, lambda lines: any("closed" in line for line in lines))
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    for entry in entries:
        assert {"time", "level", "logger", "message"} <= entry.keys(), entry
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00$", entry["time"]), entry
    (refusal,) = [e for e in entries if e["message"].startswith("refused:")]
    assert refusal["level"] == "WARNING"
    assert refusal["figures"]["requested"] == 6 * GiB - 6 * MiB
    assert refusal["figures"]["available"] == 4 * GiB - 6 * MiB  # the test daemons' host capacity is 4 GiB
    (reclaim,) = [e for e in entries if " closed: " in e["message"]]
    assert reclaim["figures"]["reclaimed"] == 6 * MiB and reclaim["figures"]["arenas"] == 1
    assert reclaim["figures"]["pid"] == client.pid and reclaim["figures"]["micros"] >= 0
