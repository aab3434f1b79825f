"""The protocol fuzzer against a real daemon: 5,000 generated cases on the host backend
(about 10 s on a 2-core machine), 1,000 on CUDA. tests/integration/fuzz_kit.py says
what it generates and what it checks; bench/fuzz.py runs the same generator longer."""

from __future__ import annotations

import time

import pytest

from fuzz_kit import MAX_CONTROL_MESSAGE, Bounds, Long, World, _least_packed_bytes, fuzz

CASES = {"host": 5000, "cuda": 1000}
ROUND_TIMEOUT = 1.0  # rounds end quickly, so deferred replies come within the run
# The daemon under fuzz: 1 GiB of host memory (8 GiB of the GPU's) makes running out of
# it reachable, and on CUDA keeps a KV round (sized from what is free) from committing and
# zeroing the whole device at every round. What a session retained stays orphaned after
# it closed until --retain-grace: short, so that the check that every byte came back once
# every session closed holds within its wait.
ARGS = ["--round-timeout", str(ROUND_TIMEOUT), "--hello-timeout", "2", "--retain-grace", str(ROUND_TIMEOUT)]


@pytest.mark.timeout(300)
def test_the_daemon_survives_the_protocol_fuzzer(daemon_factory, backend, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    args = ARGS + (["--host-capacity", "1GiB"] if backend == "host" else ["--capacity", "8GiB"])
    daemon = daemon_factory(backend, args=args)
    world = World(runtime_dir, daemon.pid, log=daemon.log)
    started = time.monotonic()
    fuzz(world, CASES[backend])
    figures = world.finish(round_wait=ROUND_TIMEOUT + 5.0, bounds=Bounds())
    seconds = time.monotonic() - started
    assert figures["cases"] >= CASES[backend] and figures["daemon_alive"]
    assert figures["errors_by_code"].get("OK", 0) > CASES[backend] // 20, f"too few requests got through to the books: {figures}"
    print(f"fuzz ({backend}): {figures['cases']} cases in {seconds:.1f}s; {figures}")


def test_a_long_list_of_long_lists_costs_its_distinct_items() -> None:
    """The shape that stalled bench/fuzz.py: RESUME holdings, a long list of holdings each
    with a long list of chunk ids (20,000 of 20,000 would be 400 million ids to resolve and
    pack). Each distinct item is resolved once and repeated, and a body past the control
    channel's bound is found so without packing it."""
    holdings = Long(({"arena": "a0", "chunks": Long((1, 2), 20_000)},), 20_000)
    world = World.__new__(World)  # no reference to resolve: no world needed
    spelled = world._resolve({"holdings": holdings}, 0)
    assert len(spelled["holdings"]) == 20_000 and len(spelled["holdings"][0]["chunks"]) == 20_000
    assert spelled["holdings"][0]["chunks"] is spelled["holdings"][-1]["chunks"], "the inner list was spelled once per holding"
    assert _least_packed_bytes(spelled, {}) > MAX_CONTROL_MESSAGE
    assert len(world._resolve(Long((7,), 20_000), 0)) == 20_000, "a long list alone stays long"
