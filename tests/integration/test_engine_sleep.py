"""EngineMemory's sleep and wake by tag against a real daemon, on every backend: weights
and graph-pool memory kept in host memory, the KV cache dropped, the memory another
session's meanwhile, everything back at the same addresses with its contents, the KV
cache at its blocks again, the graph pool registered as it was and leased as before.
(The test process plays torch's part, as in test_engine_api.py.)"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import gpumem
from gpumem_shared import protocol as p
from gpumem.port.blocks import BlockFollower
from gpumemd_testkit import MiB, status
from nanovllm_fakes import Engine, Manager

GiB = 1 << 30


def test_an_engine_sleeps_by_tag_and_wakes_as_it_was(daemon: Any, runtime_dir: Path) -> None:
    with gpumem.EngineMemory("engine", 0, runtime_dir=str(runtime_dir), model_reserve=GiB, graph_reserve=GiB) as mem:
        assert mem.model.allocator().slot.alloc(5 * MiB) == mem.model.address
        model_end = mem.model.committed - 8
        mem.model.write(0, b"weights!")
        mem.model.write(model_end, b"last row")
        kv = mem.kv_cache(layers=2, block_shape=(16, 64), itemsize=2, max_blocks=512)
        assert mem.kv_commit(max_blocks=300) == kv.blocks == 300
        kv_start = next(iter(kv.pool.buffers.values())).offset
        kv.pool.arena.write(kv_start, b"kv block")
        assert mem.graphs.allocator().slot.alloc(8 * MiB) == mem.graphs.address
        mem.graphs.write(4 * MiB, b"captured state")
        mem.graph_pool = mem.graphs.register_graph_pool("decode", extents=[p.Extent(offset=0, size=8 * MiB)], free_runs=[])
        epoch = mem.graph_pool.epoch
        held = {a: getattr(mem, a).committed for a in ("model", "graphs")} | {"kv": kv.pool.arena.committed}
        with pytest.raises(gpumem.InvalidArgument, match="the tags are weights, graphs, kv"):
            mem.sleep("optimizer")
        mem.prepare_sleep(drop=["kv"])  # the host buffers made ahead: the sleep below only copies into them
        prepared = {tag: s.host for tag, s in mem._sleepers.items()}
        assert list(prepared) == ["weights", "graphs"] and all(prepared.values())
        assert [c["host_bytes"] for c in status(runtime_dir)["clients"]] == [held["model"] + held["graphs"]]
        assert mem.asleep == []

        mem.sleep(drop=["kv"])
        assert mem.asleep == ["weights", "graphs", "kv"]
        assert {tag: mem._sleepers[tag].host for tag in prepared} == prepared
        s = status(runtime_dir)
        placeholders = sum(a["placeholder_bytes"] for a in s["arenas"])
        assert s["device"]["accounted_bytes"] == placeholders  # every committed byte went back
        assert [c["host_bytes"] for c in s["clients"]] == [held["model"] + held["graphs"]]  # the KV cache kept nothing
        asleep = {x["arena"]: (x["committed_bytes"], x["kept_bytes"]) for x in s["sleepers"] if x["asleep"]}
        assert asleep == {mem.model.name: (held["model"], held["model"]), mem.graphs.name: (held["graphs"], held["graphs"]),
                          kv.pool.name: (held["kv"], 0)}, "the KV cache sleeps, dropped, as the daemon sees it"
        with pytest.raises(gpumem.ArenaAsleep):
            mem.model.commit(held["model"] + 2 * MiB)
        assert mem.model.allocator().slot.alloc(1 * MiB) == 0  # nothing to allocate in while asleep

        # Another session commits what the engine gave back, uses it, and gives it back.
        freed = sum(held.values())
        with gpumem.connect(0, name="trainer", runtime_dir=runtime_dir, timeout=10.0) as trainer:
            scratch = trainer.create_arena("train", 4 * GiB)
            scratch.commit(freed)
            scratch.write(freed - 5, b"train")
            assert scratch.read(freed - 5, 5) == b"train"
            scratch.release()

        mem.wake()
        assert mem.asleep == []
        assert (mem.model.committed, mem.graphs.committed, kv.pool.arena.committed) == (held["model"], held["graphs"], held["kv"])
        assert kv.blocks == 300
        assert mem.model.read(0, 8) == b"weights!" and mem.model.read(model_end, 8) == b"last row"
        assert mem.graphs.read(4 * MiB, 14) == b"captured state"
        assert kv.pool.arena.read(kv_start, 8) == bytes(8)  # dropped: fresh, zeroed memory
        assert mem.graph_pool.epoch == epoch
        (pool,) = status(runtime_dir)["graph_pools"]
        assert (pool["id"], pool["epoch"]) == (mem.graph_pool.id, epoch)
        with mem.session.replay(mem.graph_pool):  # leased as before
            pass

        # Again, all kept: the host buffers of the first cycle serve the second.
        buffers = {tag: s.host for tag, s in mem._sleepers.items()}
        mem.sleep("weights", "graphs")
        assert mem.asleep == ["weights", "graphs"]
        mem.wake()
        assert {tag: s.host for tag, s in mem._sleepers.items()} == buffers
        assert mem.model.read(0, 8) == b"weights!" and mem.graphs.read(4 * MiB, 14) == b"captured state"
    s = status(runtime_dir)
    assert s["clients"] == [] and s["sleepers"] == [] and s["daemon"]["sleep_host_bytes"] == 0


def test_a_kv_cache_kept_comes_back_whole_and_its_wake_waits_for_the_rows(daemon: Any, runtime_dir: Path) -> None:
    with gpumem.EngineMemory("engine", 0, runtime_dir=str(runtime_dir), model_reserve=GiB, graph_reserve=GiB) as mem:
        kv = mem.kv_cache(layers=2, block_shape=(16, 64), itemsize=2, max_blocks=512)
        assert mem.kv_commit(max_blocks=300) == 300
        ends = [(b.offset, b.offset + 300 * b.row_bytes - 8) for b in kv.pool.buffers.values()]
        for first, last in ends:
            kv.pool.arena.write(first, b"first ro")
            kv.pool.arena.write(last, b"last row")
        kv.pool.report_demand(250)  # busy before its sleep
        mem.sleep("kv")  # kept, not dropped
        assert mem.asleep == ["kv"] and kv.pool.tokens == 0
        s = status(runtime_dir)
        (x,) = [x for x in s["sleepers"] if x["arena"] == kv.pool.name]
        assert x["asleep"] and x["kept_bytes"] > 0 and x["committed_bytes"] >= x["kept_bytes"], "the daemon knows the KV cache sleeps"
        (k,) = [k for k in s["kv"] if k["name"] == kv.pool.name]
        assert (k["tokens"], k["demand_tokens"], k["share_bytes"]) == (0, 0, 0), "asleep, it wants nothing and holds no share"
        with gpumem.connect(0, name="trainer", runtime_dir=runtime_dir, timeout=10.0) as trainer:
            device = status(runtime_dir)["device"]
            everything = (device["free_bytes"] - device["reserve_bytes"]) // device["granularity"] * device["granularity"]
            hog = trainer.create_arena("hog", everything)
            hog.commit(everything)
            with pytest.raises(gpumem.OutOfMemory, match="cannot wake within 0.2s"):
                mem.wake(wait=0.2)
            assert mem.asleep == ["kv"]
            hog.release()
        mem.wake()
        assert mem.asleep == [] and kv.blocks == 300
        assert not any(x["asleep"] for x in status(runtime_dir)["sleepers"]), "its grow back woke it in the daemon too"
        for first, last in ends:
            assert kv.pool.arena.read(first, 8) == b"first ro" and kv.pool.arena.read(last, 8) == b"last row"


def test_a_dropped_kv_cache_wakes_to_what_a_neighbour_left_and_regains_the_rest_once_it_lets_go(daemon_factory, backend, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """Issue 38's drift: the neighbour keeps a few hundred MiB of what the sleeper gave
    back. The wake takes what fits above its floor at once (no 30 s wait, no
    OutOfMemory), its block manager is sized to it and its rows are fresh memory; the
    rest comes by the grow the wake left waiting, which the follower collects once the
    neighbour lets go, with no call of the application's."""
    extra = ["--host-capacity", "1GiB"] if backend == "host" else []
    daemon_factory(backend, args=[*extra, "--capacity", "512MiB", "--reserve", "0", "--kv-chunk-size", "16MiB"])
    with gpumem.EngineMemory("engine", 0, runtime_dir=str(runtime_dir), model_reserve=GiB, graph_reserve=GiB) as mem:
        kv = mem.kv_cache(layers=2, block_shape=(16, 8, 128), itemsize=2, max_blocks=2048)  # 128 KiB a block
        assert mem.kv_commit(max_blocks=2048) == 2048  # 256 MiB
        manager = Manager(kv.blocks)
        follower = BlockFollower(kv.pool, Engine(manager))
        first = [b.offset for b in kv.pool.buffers.values()]
        for offset in first:
            kv.pool.arena.write(offset, b"old rows")
        held = status(runtime_dir)["device"]["accounted_bytes"]
        mem.sleep("kv", drop=["kv"])

        trainer = run_client("shell", "trainer")
        trainer.expect("CONNECTED")
        trainer.send(f"create train {GiB}")
        trainer.expect("OK")
        everything = 512 * MiB - status(runtime_dir)["device"]["accounted_bytes"]
        trainer.send(f"commit train {everything}")
        assert int(trainer.expect("OK")) == everything
        kept = 384 * MiB  # what the trainer keeps: half the sleeper's rows do not fit
        trainer.send(f"decommit train {kept}")
        trainer.expect("OK")

        floor = follower.wake_floor()
        assert floor == 2048 // 8
        started = time.monotonic()
        mem.wake(wait=60.0, kv_floor=floor)
        assert time.monotonic() - started < 30, "answered with what fits, not at the end of its wait"
        follower.woke()
        woken = kv.pool.tokens
        assert mem.asleep == [] and floor <= woken < 2048, woken
        assert len(manager.blocks) == woken and kv.pool.growing is not None, "sized to what the wake gave; the rest on its way"
        for offset in first:
            assert kv.pool.arena.read(offset, 8) == bytes(8)  # dropped: fresh, zeroed memory
        last = next(iter(kv.pool.buffers.values())).offset + woken * kv.pool.bytes_per_token // len(kv.pool.buffers) - 8
        kv.pool.arena.write(last, b"new rows")  # the engine's blocks are real memory up to what it got
        assert kv.pool.arena.read(last, 8) == b"new rows"

        for _ in range(3):
            follower.idle()
        assert kv.pool.tokens == woken, "the rest waits for the trainer, and the follower goes on"
        trainer.send("release train")
        trainer.expect("OK")
        deadline = time.monotonic() + 30
        while kv.pool.tokens < 2048:
            assert time.monotonic() < deadline, f"the rest never came: {kv.pool.tokens} of 2048 rows"
            follower.idle()  # what the engine's loop does anyway: no new request of the application's
        assert len(manager.blocks) == 2048 and follower.figures.grows_short == 0
        assert status(runtime_dir)["device"]["accounted_bytes"] == held


def test_a_dropped_kv_cache_whose_floor_does_not_fit_fails_its_wake_naming_the_holders(daemon_factory, backend, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    extra = ["--host-capacity", "1GiB"] if backend == "host" else []
    daemon_factory(backend, args=[*extra, "--capacity", "512MiB", "--reserve", "0", "--kv-chunk-size", "16MiB"])
    with gpumem.EngineMemory("engine", 0, runtime_dir=str(runtime_dir), model_reserve=GiB, graph_reserve=GiB) as mem:
        kv = mem.kv_cache(layers=2, block_shape=(16, 8, 128), itemsize=2, max_blocks=2048)
        assert mem.kv_commit(max_blocks=2048) == 2048
        mem.sleep("kv", drop=["kv"])
        trainer = run_client("shell", "trainer")
        trainer.expect("CONNECTED")
        trainer.send(f"create train {GiB}")
        trainer.expect("OK")
        left = 16 * MiB  # 128 blocks, under the floor of 256
        trainer.send(f"commit train {512 * MiB - status(runtime_dir)['device']['accounted_bytes'] - left}")
        trainer.expect("OK")
        with pytest.raises(gpumem.OutOfMemory, match=r"cannot wake within 0.5s: .*held by client 'trainer'"):
            mem.wake(wait=0.5, kv_floor=256)
        assert mem.asleep == ["kv"] and kv.pool.tokens == 0
