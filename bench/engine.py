#!/usr/bin/env python3
"""A third-party engine (nano-vllm) as shipped against the same engine on gpumemd, in one run.

CUDA (``--backend cuda``, nano-vllm installed; the model is built offline by
bench/nanovllm_kit.py: a random-weight Qwen3, fixed prompts, greedy):

1. shipped, gpu_memory_utilization 0.9: KV blocks, token ids, decode tokens/s (cold
   caches: this run pays the first Triton compiles);
2. shipped at 0.45: its KV blocks (what each of two hand-tuned engines would get) and
   its start-up time, the baseline for gpumemd's (warm caches, like the runs after it);
3. on gpumemd (a private daemon, started now), alone in its KV round: the same figures,
   plus the sampler's temporaries with and without borrowing the graph pool's free runs;
4. two engines on gpumemd in one round: their KV blocks and tokens; then kill -9 of one
   while it generates: the time from its death to its memory back in the daemon's books
   (STATUS polled every 2 ms), and whether the other generates the same tokens again.

Each engine is a process of its own (bench/nanovllm_kit.py engine). Ratios are against
run 1 (decode, blocks) and run 2 (start-up) of the same invocation.

Host (``--backend host``): no engine runs (nano-vllm needs CUDA); the engine API's pieces
against a host daemon: elastic growth through the allocator slot, trim, and two paged KV
caches in one round with the wait handle. Figures only say that they worked.

Last line: {"bench": "engine", ...}.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import _common as c

BENCH = "engine"
KIT = Path(__file__).resolve().parent / "nanovllm_kit.py"
MiB = 1 << 20
ENGINE_TIMEOUT = 240.0


def _engine(rd: Path, name: str, out: Path, args: list[str]) -> c.Child:
    return c.Child(name, [str(KIT), "engine", "--name", name, "--out", str(out), *args], rd / f"{name}.log")


def _result(child: c.Child, path: Path, timeout: float = ENGINE_TIMEOUT) -> dict[str, Any]:
    child.wait_for(path.exists, timeout, f"writing {path.name}")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _summary(r: dict[str, Any]) -> str:
    return f"{r['mode']} {r['name']}: {r['blocks']} blocks, start-up {r['startup_s']:.2f}s, decode {r['decode_tok_s']:.0f} tok/s"


def cuda(result: c.Result, cleanup: contextlib.ExitStack, args: Any) -> None:
    import gpumem_shared.protocol as p
    from gpumem.channel import ControlChannel
    from gpumem_shared.paths import Endpoints

    rd = cleanup.enter_context(c.runtime_dir("gmb-engine-"))
    if args.keep_logs:
        cleanup.callback(_keep_logs, rd, args.keep_logs)
    model = rd / "model"
    built = c.Child("build", [str(KIT), "build", str(model)], rd / "build.log")
    built.wait_for(lambda: built.proc.poll() == 0, 300, "building the model")
    common = ["--model", str(model), "--prompts", str(args.prompts), "--tokens", str(args.tokens)]
    f, t = result.figures, result.targets

    shipped = _engine(rd, "shipped", rd / "shipped.json", [*common, "--mode", "shipped", "--util", "0.9", "--port", "29601"])
    base = _result(shipped, rd / "shipped.json")
    shipped.stop()
    c.say(_summary(base))
    half = _engine(rd, "shipped045", rd / "half.json", [*common, "--mode", "shipped", "--util", "0.45", "--port", "29602"])
    half_r = _result(half, rd / "half.json")
    half.stop()
    c.say(_summary(half_r))

    daemon = c.Daemon(rd, "cuda").wait_ready(30)
    cleanup.callback(daemon.stop)
    on = ["--mode", "gpumemd", "--runtime-dir", str(rd)]
    solo = _engine(rd, "solo", rd / "solo.json", [*common, *on, "--expect", "1", "--port", "29603", "--borrow-figures"])
    solo_r = _result(solo, rd / "solo.json")
    solo.stop()
    c.say(_summary(solo_r))
    f.update(
        shipped_blocks=base["blocks"], gpumemd_blocks=solo_r["blocks"], kv_blocks_ratio=c.ratio(solo_r["blocks"], base["blocks"]),
        tokens_identical=solo_r["tokens"] == base["tokens"] == half_r["tokens"],
        shipped_runs_differ=_differing(base["tokens"], half_r["tokens"]),
        gpumemd_vs_shipped_differ=_differing(solo_r["tokens"], base["tokens"]),
        shipped_decode_tok_s=base["decode_tok_s"], gpumemd_decode_tok_s=solo_r["decode_tok_s"],
        decode_ratio=c.ratio(solo_r["decode_tok_s"], base["decode_tok_s"]),
        shipped_startup_s=half_r["startup_s"], gpumemd_startup_s=solo_r["startup_s"],
        extra_startup_s=solo_r["startup_s"] - half_r["startup_s"], shipped_cold_startup_s=base["startup_s"],
        model_arena=solo_r["model_usage"], graph_arena=solo_r["graphs_usage"], kv_budget=solo_r["kv_budget"],
    )
    sampler = solo_r["sampler"]
    drop = sampler["temporaries_bytes"] - sampler["borrowed_peak_bytes"]
    f.update(sampler_temporaries_bytes=sampler["temporaries_bytes"], sampler_borrowed_peak_bytes=sampler["borrowed_peak_bytes"],
             sampler_peak_drop_fraction=drop / sampler["temporaries_bytes"] if sampler["temporaries_bytes"] else 0.0)

    go = rd / "go-again"
    a = _engine(rd, "pair-a", rd / "a.json", [*common, *on, "--expect", "2", "--port", "29604", "--again-after", str(go)])
    b = _engine(rd, "pair-b", rd / "b.json", [*common, *on, "--expect", "2", "--port", "29605", "--serve-forever"])
    cleanup.callback(a.stop)
    cleanup.callback(b.stop)
    a_r, b_r = _result(a, rd / "a.json"), _result(b, rd / "b.json")
    c.say(_summary(a_r))
    c.say(_summary(b_r))
    control = ControlChannel(Endpoints(rd, 0))
    cleanup.callback(control.close)
    before = control.call(p.Status(), 5.0)
    held_b = sum(x.committed for x in before.arenas if x.owner == "pair-b")
    time.sleep(0.5)  # b is generating again
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(30)
    dead = time.monotonic()
    while True:
        status = control.call(p.Status(), 5.0)
        if not any(x.name == "pair-b" for x in status.clients) and not any(x.owner == "pair-b" for x in status.arenas):
            back = time.monotonic()
            break
        if time.monotonic() - dead > 10:
            raise RuntimeError("gpumemd still lists pair-b 10 s after its death")
        time.sleep(0.002)
    go.write_text("go")
    again = json.loads((rd / "a.json.again").read_text()) if _wait_file(a, rd / "a.json.again") else {}
    f.update(
        pair_blocks=[a_r["blocks"], b_r["blocks"]], shipped_045_blocks=half_r["blocks"],
        pair_tokens_identical=a_r["tokens"] == base["tokens"] and b_r["tokens"] == base["tokens"],
        killed_held_bytes=held_b, reclaim_ms=(back - dead) * 1000, accounted_after_bytes=status.device.accounted_bytes,
        survivor_same_tokens=bool(again.get("same_tokens")), survivor_differ=again.get("differ"),
    )
    t.update(kv_blocks_ratio=">= 1.05", tokens_identical=True, decode_ratio=">= 0.98", extra_startup_s="<= 0.5",
             pair_blocks=f">= {half_r['blocks']} each", reclaim_ms="<= 100", survivor_same_tokens=True,
             sampler_peak_drop_fraction=">= 0.95")
    result.ok = (
        f["kv_blocks_ratio"] >= 1.05 and f["tokens_identical"] and f["decode_ratio"] >= 0.98 and f["extra_startup_s"] <= 0.5
        and min(f["pair_blocks"]) >= half_r["blocks"] and f["pair_tokens_identical"] and f["reclaim_ms"] <= 100
        and f["survivor_same_tokens"] and f["sampler_peak_drop_fraction"] >= 0.95
    )


def _keep_logs(rd: Path, to: Path) -> None:
    to.mkdir(parents=True, exist_ok=True)
    for log in rd.glob("*.log"):
        shutil.copy(log, to / log.name)


def _differing(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How two runs' token ids differ: sequences that differ, and the first (sequence,
    token) where they do."""
    rows = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    first = None
    if rows:
        x, y = a[rows[0]], b[rows[0]]
        first = [rows[0], next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))]
    return {"sequences": len(rows) + abs(len(a) - len(b)), "first": first}


def _wait_file(child: c.Child, path: Path) -> bool:
    child.wait_for(path.exists, ENGINE_TIMEOUT, f"writing {path.name}")
    return True


def host(result: c.Result, cleanup: contextlib.ExitStack) -> None:
    import gpumem

    rd = cleanup.enter_context(c.runtime_dir("gmb-engine-"))
    daemon = c.Daemon(rd, "host", args=["--host-capacity", "2GiB"]).wait_ready(30)
    cleanup.callback(daemon.stop)
    a = cleanup.enter_context(gpumem.connect(0, name="engine-a", runtime_dir=rd))
    b = cleanup.enter_context(gpumem.connect(0, name="engine-b", runtime_dir=rd))
    arena = a.create_arena("model", 8 << 30).set_elastic(step=64 * MiB)
    slot = arena.allocator().slot
    grows = []
    for _ in range(8):
        started = time.perf_counter()
        if not slot.alloc(64 * MiB):
            raise RuntimeError(f"elastic growth failed: {arena.allocator().grow_error}")
        grows.append((time.perf_counter() - started) * 1000)
    usage = arena.usage()
    trimmed = arena.trim()
    caches = [s.declare_paged_kv(f"kv-{s.name}", layers=4, block_shape=(256, 4, 64), itemsize=2, expect=2) for s in (a, b)]
    started = time.perf_counter()
    pending = [cache.capture_done(max_blocks=256, wait=False) for cache in caches]
    blocks = [handle.wait() for handle in pending]
    result.figures.update(grow_ms_median=c.median(grows), grows=usage.grows, committed=usage.committed, trimmed_bytes=trimmed,
                          round_blocks=blocks, round_ms=(time.perf_counter() - started) * 1000)
    result.targets.update(grows=8, round_blocks=[256, 256])
    result.ok = usage.grows == 8 and blocks == [256, 256]


def main() -> int:
    parser = c.ArgumentParser(BENCH, description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["cuda", "host"], default="cuda")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--keep-logs", type=Path, default=None, help="copy every process's log here (CUDA)")
    args = parser.parse_args()
    c.ensure_importable()
    if args.backend == "host":
        return c.run(BENCH, args.backend, host)
    return c.run(BENCH, args.backend, lambda result, cleanup: cuda(result, cleanup, args))


if __name__ == "__main__":
    sys.exit(main())
