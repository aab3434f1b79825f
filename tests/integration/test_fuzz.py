"""The protocol fuzzer against a real daemon: 5,000 generated cases on the host backend
(about 10 s on a 2-core machine), 1,000 on CUDA. tests/integration/fuzz_kit.py says
what it generates and what it checks; bench/fuzz.py runs the same generator longer."""

from __future__ import annotations

import time

import pytest

from fuzz_kit import Bounds, World, fuzz

CASES = {"host": 5000, "cuda": 1000}
ROUND_TIMEOUT = 1.0  # rounds end quickly, so deferred replies come within the run
# The daemon under fuzz: 1 GiB of host memory makes running out of it reachable. What a
# session retained stays orphaned after it closed until --retain-grace: short, so that the
# check that every byte came back once every session closed holds within its wait.
ARGS = ["--round-timeout", str(ROUND_TIMEOUT), "--hello-timeout", "2", "--retain-grace", str(ROUND_TIMEOUT)]


@pytest.mark.timeout(300)
def test_the_daemon_survives_the_protocol_fuzzer(daemon_factory, backend, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    args = ARGS + (["--host-capacity", "1GiB"] if backend == "host" else [])
    daemon = daemon_factory(backend, args=args)
    world = World(runtime_dir, daemon.pid, log=daemon.log)
    started = time.monotonic()
    fuzz(world, CASES[backend])
    figures = world.finish(round_wait=ROUND_TIMEOUT + 5.0, bounds=Bounds())
    seconds = time.monotonic() - started
    assert figures["cases"] >= CASES[backend] and figures["daemon_alive"]
    assert figures["errors_by_code"].get("OK", 0) > CASES[backend] // 20, f"too few requests got through to the books: {figures}"
    print(f"fuzz ({backend}): {figures['cases']} cases in {seconds:.1f}s; {figures}")
