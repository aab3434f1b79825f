"""The host quickstart runs as a newcomer would run it (no torch, no GPU) against a real
daemon, and what it shows is true; the extents it passes as (offset, size) pairs are
accepted, and anything else is refused in Python's terms."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import gpumem
from conftest import ROOT, child_env
from gpumem_shared import protocol as p

QUICKSTART = ROOT / "examples" / "host_quickstart.py"
MiB = 1 << 20


def test_the_host_quickstart_runs_every_step(daemon_factory, runtime_dir: Path) -> None:  # type: ignore[no-untyped-def]
    daemon_factory("host")
    env = child_env(runtime_dir)
    env.pop("GPUMEMD_RUNTIME_DIR")  # the example is told where, as a user would tell it
    result = subprocess.run(
        [sys.executable, str(QUICKSTART), "--runtime-dir", str(runtime_dir)], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result
    lines = result.stdout.splitlines()
    assert lines[-1] == "quickstart: ok", result.stdout
    assert "2. arena 'quickstart': 16 MiB committed, reads b'hello from owner'" in lines, result.stdout
    assert "3. the peer read 'hello from owner' and wrote b'hello back' into the shared arena" in lines, result.stdout
    assert "4. one commit round sized both KV pools: kv-owner 1024 tokens, kv-peer 1024 tokens" in lines, result.stdout
    assert any(line.startswith("5. graph pool ") and "lease held=True (replay by quickstart)" in line for line in lines), result.stdout


def test_extents_are_extents_or_pairs_and_anything_else_is_named(daemon_factory, runtime_dir: Path) -> None:  # type: ignore[no-untyped-def]
    daemon_factory("host")
    assert gpumem.Extent is p.Extent
    with gpumem.connect(0, name="extents", runtime_dir=runtime_dir, timeout=10.0) as session:
        arena = session.create_arena("pools", 64 * MiB)
        arena.commit(16 * MiB)
        pool = arena.register_graph_pool("pairs", extents=[(0, 4 * MiB), gpumem.Extent(offset=4 * MiB, size=4 * MiB)], free_runs=[(MiB, MiB)])
        assert [(e.offset, e.size) for e in pool.extents] == [(0, 4 * MiB), (4 * MiB, 4 * MiB)]
        assert [(r.offset, r.size) for r in pool.free_runs] == [(MiB, MiB)]
        for bad, says in [
            ([(0, 4 * MiB, 1)], r"extents: \(0, 4194304, 1\) is neither a gpumem.Extent nor an \(offset, size\) pair of ints"),
            ([{"offset": 0, "size": 4 * MiB}], "is neither a gpumem.Extent nor an"),
            ([(0.0, 4 * MiB)], "pair of ints"),
            ((0, 4 * MiB), r"extents: 0 is neither"),
            ("0:4MiB", "must be a list of gpumem.Extent or \\(offset, size\\) pairs, not str"),
        ]:
            with pytest.raises(gpumem.InvalidArgument, match=says):
                arena.register_graph_pool("bad", extents=bad)  # type: ignore[arg-type]
        assert [g.label for g in session.status().graph_pools] == ["pairs"], "nothing refused reached the registry"
