"""Sleep and wake with a real daemon and real client processes, on every backend: the
contents come back at the same addresses, a co-tenant commits and uses the freed memory
meanwhile, host buffers are accounted and limited, and a sleeper killed (asleep, or with
its copy made and its chunks not handed back yet) or a daemon restarted under it leaves
nothing wrong behind."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import child_env
from fdstore_kit import Restartable
from gpumemd_testkit import status, wait_status

MiB = 1 << 20
GiB = 1 << 30
RESERVE = 64 * GiB
WEIGHTS = 1 * GiB + 6 * MiB  # two bulk chunks and a tail ladder
SCRATCH = 256 * MiB
# What the daemon commits in all (--capacity, no reserve): the sleeper's arenas and a
# little more, so that a co-tenant can hold every byte and a wake must wait for it.
CAPACITY = WEIGHTS + SCRATCH + 64 * MiB
CAPPED = ["--reserve", "0", "--capacity", str(CAPACITY)]


def _engine(run_client, name: str = "engine"):  # type: ignore[no-untyped-def]
    engine = run_client("shell", name)
    engine.expect("CONNECTED")
    engine.send(f"create weights {RESERVE}")
    address = int(engine.expect("OK"))
    engine.send(f"commit weights {WEIGHTS}")
    engine.expect("OK")
    engine.send(f"fill weights 0 {WEIGHTS} 171")
    engine.expect("OK")
    engine.send(f"write weights {WEIGHTS - 4} 0badf00d")
    engine.expect("OK")
    return engine, address


def test_contents_come_back_at_the_same_addresses_and_a_cotenant_uses_the_memory(daemon_factory, backend, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon_factory(backend, args=CAPPED)
    engine, address = _engine(run_client)
    engine.send(f"create scratch {RESERVE}")
    scratch_address = int(engine.expect("OK"))
    engine.send(f"commit scratch {SCRATCH}")
    engine.expect("OK")
    engine.send(f"fill scratch 0 {SCRATCH} 90")
    engine.expect("OK")
    before = status(runtime_dir)["device"]["accounted_bytes"]
    assert before == WEIGHTS + SCRATCH

    engine.send("sleep weights keep")
    assert json.loads(engine.expect("OK")) == {"committed": 0, "host": WEIGHTS}
    engine.send("sleep scratch drop")
    assert json.loads(engine.expect("OK")) == {"committed": 0, "host": 0}
    s = status(runtime_dir)
    assert s["device"]["accounted_bytes"] == 0
    assert [c["host_bytes"] for c in s["clients"]] == [WEIGHTS]
    assert s["daemon"]["sleep_host_bytes"] == WEIGHTS
    assert {x["arena"]: (x["asleep"], x["committed_bytes"], x["kept_bytes"]) for x in s["sleepers"]} == {
        "weights": (True, WEIGHTS, WEIGHTS), "scratch": (True, SCRATCH, 0),
    }
    engine.send(f"commit weights {WEIGHTS}")
    assert engine.expect("ERR").startswith("ArenaAsleep")

    # A trainer stand-in commits every byte the sleeper gave back, uses it, and gives it back.
    trainer = run_client("shell", "trainer")
    trainer.expect("CONNECTED")
    trainer.send(f"create train {RESERVE}")
    trainer.expect("OK")
    trainer.send(f"commit train {CAPACITY}")  # every byte the sleeper gave back, and the rest
    assert int(trainer.expect("OK")) == CAPACITY
    trainer.send(f"fill train 0 {CAPACITY} 7")
    trainer.expect("OK")
    trainer.send(f"check train 0 {CAPACITY} 7")
    assert trainer.expect("OK") == "MATCH"
    engine.send("wake weights 0")  # no waiting: the memory is the trainer's
    refusal = engine.expect("ERR")
    assert refusal.startswith("OutOfMemory") and "client 'trainer'" in refusal
    trainer.send("release train")
    trainer.expect("OK")

    engine.send("wake weights")
    assert json.loads(engine.expect("OK"))["committed"] == WEIGHTS
    engine.send("wake scratch")
    engine.expect("OK")
    engine.send("address weights")
    assert int(engine.expect("OK")) == address
    engine.send("address scratch")
    assert int(engine.expect("OK")) == scratch_address
    engine.send(f"check weights 0 {WEIGHTS - 4} 171")
    assert engine.expect("OK") == "MATCH"
    engine.send(f"read weights {WEIGHTS - 4} 4")
    assert engine.expect("OK") == "0badf00d"
    engine.send(f"check scratch 0 {SCRATCH} 0")  # dropped: fresh memory, zeroed (the trainer's 7s are not there)
    assert engine.expect("OK") == "MATCH"
    s = status(runtime_dir)
    assert s["device"]["accounted_bytes"] == WEIGHTS + SCRATCH
    assert {x["arena"]: x["asleep"] for x in s["sleepers"]} == {"weights": False}  # the buffer stays for the next sleep

    # A second cycle reuses the host buffer; freeing it gives the host memory back.
    engine.send("write weights 0 c0ffee")
    engine.expect("OK")
    engine.send("sleep weights keep")
    engine.expect("OK")
    engine.send("wake weights")
    engine.expect("OK")
    engine.send("read weights 0 3")
    assert engine.expect("OK") == "c0ffee"
    engine.send("freehost weights")
    engine.expect("OK")
    s = status(runtime_dir)
    assert s["daemon"]["sleep_host_bytes"] == 0 and s["sleepers"] == []


def test_a_host_buffer_made_ahead_is_the_one_the_first_sleep_fills(daemon_factory, backend, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """ArenaSleep.prepare: the buffer exists and is accounted before any sleep (its
    registration paid then), the first sleep copies into it rather than into a second
    one, and the wake brings the contents back."""
    daemon_factory(backend, args=CAPPED)
    engine, _ = _engine(run_client)
    engine.send("sleepprep weights")
    assert json.loads(engine.expect("OK")) == {"committed": WEIGHTS, "host": WEIGHTS}
    s = status(runtime_dir)
    assert s["daemon"]["sleep_host_bytes"] == WEIGHTS and [c["host_bytes"] for c in s["clients"]] == [WEIGHTS]
    assert s["device"]["accounted_bytes"] == WEIGHTS  # awake: on the device still
    assert {x["arena"]: x["asleep"] for x in s["sleepers"]} == {"weights": False}
    engine.send("sleep weights keep")
    assert json.loads(engine.expect("OK")) == {"committed": 0, "host": WEIGHTS}
    s = status(runtime_dir)
    assert s["daemon"]["sleep_host_bytes"] == WEIGHTS and s["device"]["accounted_bytes"] == 0  # the same buffer, not a second
    engine.send("wake weights")
    engine.expect("OK")
    engine.send(f"check weights 0 {WEIGHTS - 4} 171")
    assert engine.expect("OK") == "MATCH"
    engine.send(f"read weights {WEIGHTS - 4} 4")
    assert engine.expect("OK") == "0badf00d"
    engine.send("sleep weights keep")
    engine.expect("OK")
    engine.send("sleepprep weights")  # asleep: its buffer holds the contents
    assert engine.expect("ERR").startswith("InvalidArgument")


def test_a_wake_waits_for_memory_others_give_back(daemon_factory, backend, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory(backend, args=CAPPED)
    engine, _ = _engine(run_client)
    engine.send("sleep weights drop")
    engine.expect("OK")
    trainer = run_client("shell", "trainer")
    trainer.expect("CONNECTED")
    trainer.send(f"create train {RESERVE}")
    trainer.expect("OK")
    trainer.send(f"commit train {CAPACITY}")
    trainer.expect("OK")
    engine.send("wake weights 60")
    # The daemon holds the wake's answer (its log says so): the wake waits, it did not come late.
    deadline = time.monotonic() + 30
    while "waking arena 'weights' of client 'engine'" not in daemon.log():
        assert time.monotonic() < deadline, f"no wake waited:\n{daemon.log()}"
        time.sleep(0.02)
    trainer.send("release train")
    trainer.expect("OK")
    assert json.loads(engine.expect("OK", timeout=60))["committed"] == WEIGHTS
    # One ARENA_WAKE, answered once the memory came free: the client did not poll.
    log = daemon.log()
    assert log.count("waking arena 'weights' of client 'engine'") == 1 and "refused: waking arena" not in log, log


def test_host_buffers_beyond_the_limit_are_refused_naming_it(daemon_factory, backend, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon_factory(backend, args=["--sleep-host-limit", "512MiB"])
    engine, _ = _engine(run_client)
    engine.send("sleep weights keep")
    refusal = engine.expect("ERR")
    assert refusal.startswith("HostLimit") and "of the 512 MiB limit" in refusal and "--sleep-host-limit" in refusal
    engine.send(f"read weights {WEIGHTS - 4} 4")  # refused before anything was handed back
    assert engine.expect("OK") == "0badf00d"
    engine.send("sleep weights drop")
    engine.expect("OK")
    assert status(runtime_dir)["daemon"]["sleep_host_bytes"] == 0


@pytest.mark.parametrize("stage", ["asleep", "copied"])
def test_a_sleeper_killed_leaves_others_untouched_and_its_memory_reclaimed(daemon, run_client, runtime_dir, stage) -> None:  # type: ignore[no-untyped-def]
    engine, _ = _engine(run_client)
    trainer = run_client("shell", "trainer")
    trainer.expect("CONNECTED")
    trainer.send(f"create train {RESERVE}")
    trainer.expect("OK")
    trainer.send(f"commit train {SCRATCH}")
    trainer.expect("OK")
    trainer.send(f"fill train 0 {SCRATCH} 7")
    trainer.expect("OK")
    engine.send("sleep weights keep" if stage == "asleep" else "sleepstage weights")
    assert json.loads(engine.expect("OK"))["host"] == WEIGHTS
    assert status(runtime_dir)["daemon"]["sleep_host_bytes"] == WEIGHTS
    engine.kill()
    s = wait_status(runtime_dir, lambda st: len(st["clients"]) == 1, 5.0, "the sleeper's session dropped")
    assert s["sleepers"] == [] and s["daemon"]["sleep_host_bytes"] == 0
    assert s["device"]["accounted_bytes"] == SCRATCH
    assert [a["name"] for a in s["arenas"]] == ["train"]
    trainer.send(f"check train 0 {SCRATCH} 7")
    assert trainer.expect("OK") == "MATCH"


@pytest.fixture
def service(runtime_dir: Path, backend: str) -> Iterator[Restartable]:
    r = Restartable(runtime_dir, backend, [], child_env(runtime_dir)).start()
    yield r
    r.close()


def test_a_daemon_restart_keeps_the_sleeper(service, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    engine, address = _engine(run_client)
    engine.send("sleep weights keep")
    engine.expect("OK")
    service.restart()
    s = wait_status(runtime_dir, lambda st: st["daemon"]["generation"] == 1, 10.0, "the daemon back with its state")
    assert [(x["arena"], x["asleep"], x["kept_bytes"]) for x in s["sleepers"]] == [("weights", True, WEIGHTS)]
    assert s["daemon"]["sleep_host_bytes"] == WEIGHTS and s["device"]["accounted_bytes"] == 0
    engine.send("wake weights")  # the session resumes on its own
    assert json.loads(engine.expect("OK", timeout=30))["committed"] == WEIGHTS
    engine.send("address weights")
    assert int(engine.expect("OK")) == address
    engine.send(f"check weights 0 {WEIGHTS - 4} 171")
    assert engine.expect("OK") == "MATCH"
    engine.send(f"read weights {WEIGHTS - 4} 4")
    assert engine.expect("OK") == "0badf00d"
