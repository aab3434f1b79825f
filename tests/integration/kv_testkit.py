"""Helpers for the KV pool and commit-round integration tests.

- ``Engine``: a tests/clients.py shell that declares one KV pool and drives it through
  a round (placeholder, join, capture-done), as an engine would.
- ``cost`` / ``expected_split``: the budget split as documented in gpumemd/kv.py,
  recomputed from the figures a round reports, so the same expectations hold on the
  host backend (fixed capacity) and on CUDA (whatever the GPU has free).
- ``ctl`` / ``ctl_json``: gpumemctl in its own process.
- ``snapshot``: what a refused request must leave unchanged (accounting, pools, rounds).

Every wait is bounded.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conftest import child_env
from gpumemd_testkit import GRANULARITY, MiB, do, reply, status

# How long a capture-done may block in these tests (rounds here commit in well under a second).
CAPTURE_WAIT = 20.0


def align_up(value: int, alignment: int = GRANULARITY) -> int:
    return (value + alignment - 1) // alignment * alignment


def cost(rows: list[int], tokens: int) -> int:
    """Bytes committed for ``tokens`` rows of every buffer (each prefix granule-aligned)."""
    return sum(align_up(tokens * row) for row in rows)


def most_within(rows: list[int], nbytes: int, cap: int) -> int:
    lo, hi = 0, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(rows, mid) <= nbytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def expected_split(members: list[dict[str, Any]], budget: int) -> list[int]:
    """Tokens per member (each: rows, min, max, weight), in the round's member order:
    minimums first, the rest in proportion to the weights (in bytes), each capped at
    its max, what a capped member cannot use going back to the others."""
    tokens = [m["min"] for m in members]
    spare = budget - sum(cost(m["rows"], m["min"]) for m in members)
    assert spare >= 0, f"the minimums do not fit the budget {budget}"
    active = [i for i, m in enumerate(members) if m["max"] > m["min"]]
    while active and spare > 0:
        total = sum(members[i]["weight"] for i in active)
        capped = []
        for i in active:
            m = members[i]
            if cost(m["rows"], m["max"]) - cost(m["rows"], tokens[i]) <= spare * m["weight"] / total:
                capped.append(i)
        if not capped:
            for i in active:
                m = members[i]
                share = math.floor(spare * m["weight"] / total)
                tokens[i] = most_within(m["rows"], cost(m["rows"], tokens[i]) + share, m["max"])
            break
        for i in capped:
            m = members[i]
            spare -= cost(m["rows"], m["max"]) - cost(m["rows"], tokens[i])
            tokens[i] = m["max"]
            active.remove(i)
    return tokens


def prefix_ranges(buffers: dict[str, list[int]], tokens: int) -> list[list[int]]:
    """The merged [start, end) offsets of every buffer's committed prefix."""
    spans = sorted((off, off + align_up(tokens * row)) for off, row, _region in buffers.values() if tokens)
    out: list[list[int]] = []
    for start, end in spans:
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        elif start < end:
            out.append([start, end])
    return out


class Engine:
    """One client process holding one KV pool, on the daemon of ``device``."""

    def __init__(self, run_client: Any, name: str, pool: str, rows: list[int], max_tokens: int, device: int = 0) -> None:
        self.name = name
        self.pool = pool
        self.rows = rows
        self.client = run_client("shell", name, str(device))
        self.client.expect("CONNECTED", timeout=CAPTURE_WAIT)
        self.layout = self.declare(max_tokens)
        self.min = 0
        self.max = 0
        self.weight = 1.0
        self.headroom = 0
        self.graph_pool = 0

    @property
    def pid(self) -> int:
        return int(self.client.pid)

    def declare(self, max_tokens: int) -> dict[str, Any]:
        spec = json.dumps([[f"b{i}", row, 0] for i, row in enumerate(self.rows)]).replace(" ", "")
        return json.loads(do(self.client, f"kvdeclarex {self.pool} {max_tokens} 0 {spec}"))  # type: ignore[no-any-return]

    def placeholder_and_join(self, expect: int = 0) -> int:
        do(self.client, f"kvplaceholder {self.pool}")
        round_id, _state = do(self.client, f"joinx {self.pool} {expect}" if expect else f"join {self.pool}").split()
        return int(round_id)

    def report(
        self, *, headroom: int = 0, graph_pool: int = 0, min_tokens: int = 0, max_tokens: int = 0, weight: float = 1.0
    ) -> None:
        """Send capture-done; the answer comes when the round commits (see ``result``)."""
        self.headroom, self.graph_pool, self.min, self.weight = headroom, graph_pool, min_tokens, weight
        self.max = max_tokens or self.layout["max_tokens"]
        self.client.send(f"capturex {self.pool} {headroom} {graph_pool} {min_tokens} {max_tokens} {weight}")

    def result(self, timeout: float = CAPTURE_WAIT) -> dict[str, Any]:
        line = self.client.expect("", timeout)
        assert line.startswith("OK "), f"{self.name}: capture-done answered {line!r}"
        return json.loads(line[3:])  # type: ignore[no-any-return]

    def answer(self, timeout: float = CAPTURE_WAIT) -> str:
        """The raw answer line to an earlier ``report`` (an error, say)."""
        return str(self.client.expect("", timeout))

    def do(self, command: str, timeout: float = CAPTURE_WAIT) -> str:
        return do(self.client, command, timeout)

    def reply(self, command: str, timeout: float = CAPTURE_WAIT) -> str:
        return reply(self.client, command, timeout)

    def spec(self) -> dict[str, Any]:
        return {"rows": self.rows, "min": self.min, "max": self.max, "weight": self.weight}

    def kvcheck(self) -> str:
        return self.do(f"kvcheck {self.pool}")


def headroom_for(runtime_dir: Path, target_budget: int, others: int) -> int:
    """The headroom that leaves a round a budget of about ``target_budget`` once the
    other members' ``others`` bytes of headroom are taken off too."""
    dev = status(runtime_dir)["device"]
    headroom = dev["free_bytes"] - dev["reserve_bytes"] - target_budget - others
    assert headroom >= 0, f"the device has too little free for a {target_budget}-byte budget: {dev}"
    return int(headroom)


def ctl(runtime_dir: Path, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpumem.ctl", *args, "--runtime-dir", str(runtime_dir)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(runtime_dir),
    )


def ctl_json(runtime_dir: Path, command: str) -> Any:
    result = ctl(runtime_dir, command, "--json")
    assert result.returncode == 0 and result.stderr == "", result
    return json.loads(result.stdout)


def round_by_id(runtime_dir: Path, round_id: int) -> dict[str, Any]:
    rounds = status(runtime_dir)["rounds"]
    match = [r for r in rounds if r["id"] == round_id]
    assert match, f"no round {round_id} in {rounds}"
    return match[0]  # type: ignore[no-any-return]


def wait_round(runtime_dir: Path, round_id: int, predicate: Any, what: str, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        r = round_by_id(runtime_dir, round_id)
        if predicate(r):
            return r
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within {timeout}s; round is {r}")
        time.sleep(0.02)


def snapshot(s: dict[str, Any]) -> dict[str, Any]:
    """What a refused request must leave exactly as it was (deadlines tick on)."""
    rounds = [{k: v for k, v in r.items() if k != "deadline_in_s"} for r in s["rounds"]]
    return {
        "accounted_bytes": s["device"]["accounted_bytes"],
        "arenas": s["arenas"],
        "clients": s["clients"],
        "kv": s["kv"],
        "rounds": rounds,
    }


__all__ = ["MiB"]
