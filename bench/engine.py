#!/usr/bin/env python3
"""A third-party engine (nano-vllm) as shipped against the same engine on gpumemd, in one run.

``--engine nanovllm|transformers`` picks the engine: its kit (``KITS``: a script with the
``build MODEL_DIR`` and ``engine ...`` commands bench/nanovllm_kit.py has, each engine
process writing the same JSON) runs every process below; the figures name the engine
(``"engine"`` beside ``"bench"`` in the last line). nano-vllm's kit is bench/nanovllm_kit.py. transformers' continuous
batching runs its own processes and baselines (bench/transformers_kit.py, ``cuda``): plain
transformers at its own sizing (0.9) and at half, a plain pair started at the same
moment, then on gpumemd one engine alone and a pair started at the same moment: KV
blocks, token ids, decode tokens/s and start-up against the plain ones, the issue's
targets (``--engine transformers --backend cuda``).

CUDA (``--backend cuda``, nano-vllm installed; the model is built offline by
bench/nanovllm_kit.py: a random-weight Qwen3, fixed prompts, greedy):

1. shipped, gpu_memory_utilization 0.9: KV blocks, token ids, decode tokens/s (cold
   caches: this run pays the first Triton compiles), and an eager A/B of the stand-in's
   decode attention (masked as now, and the first stand-in's way);
2. shipped at 0.45: its KV blocks (what each of two hand-tuned engines would get) and
   its start-up time, the baseline for gpumemd's (warm caches, like the runs after it);
3. on gpumemd (a private daemon, started now), alone in its KV round: the same figures,
   plus the sampler's temporaries with and without borrowing the graph pool's free runs;
4. two engines on gpumemd in one round: their KV blocks and tokens; then kill -9 of one
   while it generates: the time from its death to its memory back in the daemon's books
   (STATUS polled every 2 ms), and whether the other generates the same tokens again;
5. decode in turns: a shipped engine (0.3) starts beside the survivor, both are pinned
   to the same four CPUs, and the two run timed passes of the batch one at a time, who
   goes first alternating (``--duel-rounds`` each); a pass's figure comes from its
   median decode step, and ``decode_ratio`` is the ratio of the medians over the passes.

Each engine is a process of its own (bench/nanovllm_kit.py engine), started at the
beginning so that its imports overlap the rest, and building its engine when told.
Each generates the batch once with a probe (the tokens compared across engines, the
top-1/top-2 logit gap of every step, a checksum of each step's logits, rows with a
non-finite logit), then ``--passes`` timed passes (same tokens again: ``repeat_differ``;
the median wall time per step of ``run``, ``replay`` and ``sampler``: where gpumemd's
per-step cost goes). Token comparisons name the first differing (sequence, token), both
runs' logit gaps there, how many gaps of the steps both took from the same tokens were
equal to the bit, how many steps from the first had alike logits, and the widest split.
The KV blocks ratio is against run 1, the start-up against run 2, the decode ratio from
step 5 (run 3 against run 1 also shown, ``decode_ratio_separate_runs``: processes apart
are noisy).

Host (``--backend host``): no engine runs (nano-vllm needs CUDA); the engine API's pieces
against a host daemon: elastic growth through the allocator slot, trim, and two paged KV
caches in one round with the wait handle. Figures only say that they worked.

Last line: {"bench": "engine", ...}.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import _common as c
from token_margins import differing, parting_point

BENCH = "engine"
# Each engine's kit: the processes the CUDA run starts (see the module doc).
KITS = {"nanovllm": Path(__file__).resolve().parent / "nanovllm_kit.py"}
ENGINES = ("nanovllm", "transformers")
MiB = 1 << 20
ENGINE_TIMEOUT = 240.0


def _kit(engine: str) -> Path:
    kit = KITS.get(engine)
    if kit is None:
        raise RuntimeError(f"--engine {engine}: no kit yet (bench/{engine}_kit.py with the build and engine commands of "
                           f"bench/nanovllm_kit.py, registered in KITS); the engines with one: {', '.join(sorted(KITS))}")
    return kit


def _engine(kit: Path, rd: Path, name: str, args: list[str]) -> c.Child:
    return c.Child(name, [str(kit), "engine", "--name", name, "--out", str(rd / f"{name}.json"), *args], rd / f"{name}.log")


def _result(child: c.Child, path: Path, timeout: float = ENGINE_TIMEOUT) -> dict[str, Any]:
    child.wait_for(path.exists, timeout, f"writing {path.name}")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _summary(r: dict[str, Any]) -> str:
    return (f"{r['mode']} {r['name']}: {r['blocks']} blocks, start-up {r['startup_s']:.2f}s, decode {r['decode_tok_s']:.0f} tok/s "
            f"(passes {', '.join(f'{x:.0f}' for x in r['decode_passes_tok_s'])}; step parts ms {r.get('step_parts_ms')}), "
            f"repeat differ {r['repeat_differ']}, non-finite logit rows {r['nonfinite_logit_rows']}, sdpa {r.get('sdpa')}, "
            f"kv scan {r.get('kv_scan')}, ab {_ab(r)}")


def _ab(r: dict[str, Any]) -> Any:
    ab = r.get("attention_ab")
    return None if ab is None else {k: v for k, v in ab.items() if k != "tokens"}


def cuda(result: c.Result, cleanup: contextlib.ExitStack, args: Any) -> None:
    import gpumem_shared.protocol as p
    from gpumem.control import ControlChannel
    from gpumem_shared.paths import Endpoints

    kit = _kit(args.engine)
    rd = cleanup.enter_context(c.runtime_dir("gmb-engine-"))
    if args.keep_logs:
        cleanup.callback(_keep_logs, rd, args.keep_logs)
    model = rd / "model"
    duel_dir = rd / "duel"
    duel_dir.mkdir()
    go = {phase: rd / f"go-{phase}" for phase in ("shipped", "half", "solo", "pair", "again", "duel")}
    common = ["--model", str(model), "--prompts", str(args.prompts), "--tokens", str(args.tokens)]
    on = ["--mode", "gpumemd", "--runtime-dir", str(rd), *(["--headroom", str(args.headroom_mib)] if args.headroom_mib is not None else [])]
    f, t = result.figures, result.targets
    t.update(kv_blocks_ratio=">= 1.05", tokens_identical=True, decode_ratio=">= 0.98", extra_startup_s="<= 0.5",
             pair_blocks=">= shipped_045_blocks each", reclaim_ms="<= 100", survivor_same_tokens=True,
             sampler_peak_drop_fraction=">= 0.95")

    # Every engine process starts now and imports while the model is built and the others
    # run; each builds its engine when its go file appears (what is timed starts there).
    def engine(name: str, phase: str, extra: list[str]) -> c.Child:
        child = _engine(kit, rd, name, [*common, "--start-after", str(go[phase]), *extra])
        cleanup.callback(child.stop)
        return child

    shipped = engine("shipped", "shipped", ["--mode", "shipped", "--util", "0.9", "--port", "29601", "--ab-attention"])
    half = engine("shipped045", "half", ["--mode", "shipped", "--util", "0.45", "--port", "29602"])
    solo = engine("solo", "solo", [*on, "--expect", "1", "--port", "29603", "--borrow-figures", "--ab-attention"])
    a = engine("pair-a", "pair", [*on, "--expect", "2", "--port", "29604", "--again-after", str(go["again"]), "--duel", str(duel_dir)])
    b = engine("pair-b", "pair", [*on, "--expect", "2", "--port", "29605", "--serve-forever"])
    # A shipped engine beside the survivor once its partner is gone: decode in turns with it.
    rival = engine("duel-shipped", "duel", ["--mode", "shipped", "--util", "0.3", "--port", "29606", "--passes", "0",
                                            "--duel", str(duel_dir)])
    built = c.Child("build", [str(kit), "build", str(model)], rd / "build.log")
    built.wait_for(lambda: built.proc.poll() == 0, 300, "building the model")

    go["shipped"].write_text("go")
    base = _result(shipped, rd / "shipped.json")
    shipped.stop()
    c.say(_summary(base))
    f.update(shipped_blocks=base["blocks"], shipped_cold_startup_s=base["startup_s"], shipped_decode_tok_s=base["decode_tok_s"],
             shipped_kv_scan=base.get("kv_scan"), shipped_attention_ab=_ab(base), sdpa=base.get("sdpa"),
             shipped_step_parts_ms=base.get("step_parts_ms"))
    go["half"].write_text("go")
    half_r = _result(half, rd / "shipped045.json")
    half.stop()
    c.say(_summary(half_r))
    f.update(shipped_045_blocks=half_r["blocks"], shipped_startup_s=half_r["startup_s"], shipped_045_decode_tok_s=half_r["decode_tok_s"],
             shipped_runs_differ=_differing(base, half_r), shipped_045_kv_scan=half_r.get("kv_scan"))

    daemon = c.Daemon(rd, "cuda").wait_ready(30)
    cleanup.callback(daemon.stop)
    for child in (solo, a, b):  # before the daemon, on the way out
        cleanup.callback(child.stop)
    go["solo"].write_text("go")
    solo_r = _result(solo, rd / "solo.json")
    solo.stop()
    c.say(_summary(solo_r))
    sampler = solo_r["sampler"]
    drop = sampler["temporaries_bytes"] - sampler["borrowed_peak_bytes"]
    f.update(
        gpumemd_blocks=solo_r["blocks"], kv_blocks_ratio=c.ratio(solo_r["blocks"], base["blocks"]),
        tokens_identical=solo_r["tokens"] == base["tokens"], gpumemd_vs_shipped_differ=_differing(solo_r, base),
        gpumemd_decode_tok_s=solo_r["decode_tok_s"], decode_ratio_separate_runs=c.ratio(solo_r["decode_tok_s"], base["decode_tok_s"]),
        gpumemd_startup_s=solo_r["startup_s"], extra_startup_s=solo_r["startup_s"] - half_r["startup_s"],
        gpumemd_kv_scan=solo_r.get("kv_scan"), gpumemd_attention_ab=_ab(solo_r), borrow_overlaps=solo_r.get("borrow_overlaps"),
        gpumemd_step_parts_ms=solo_r.get("step_parts_ms"),
        eager_gpumemd_vs_shipped_differ=_eager_differ(solo_r, base),
        model_arena=solo_r["model_usage"], graph_arena=solo_r["graphs_usage"], kv_budget=solo_r["kv_budget"],
        after_round=solo_r["after_round"],
        sampler_temporaries_bytes=sampler["temporaries_bytes"], sampler_borrowed_peak_bytes=sampler["borrowed_peak_bytes"],
        sampler_peak_drop_fraction=drop / sampler["temporaries_bytes"] if sampler["temporaries_bytes"] else 0.0,
    )

    go["pair"].write_text("go")
    a_r, b_r = _result(a, rd / "pair-a.json"), _result(b, rd / "pair-b.json")
    c.say(_summary(a_r))
    c.say(_summary(b_r))
    f.update(pair_blocks=[a_r["blocks"], b_r["blocks"]], pair_tokens_identical=a_r["tokens"] == base["tokens"] == b_r["tokens"],
             pair_differ=[_differing(a_r, base)["sequences"], _differing(b_r, base)["sequences"]])
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
    f.update(killed_held_bytes=held_b, reclaim_ms=(back - dead) * 1000, accounted_after_bytes=status.device.accounted_bytes)
    go["again"].write_text("go")
    again = _result(a, rd / "pair-a.json.again")
    f.update(survivor_same_tokens=bool(again.get("same_tokens")), survivor_differ=again.get("differ"))

    # Decode in turns: the survivor (gpumemd) and a shipped engine started beside it, both
    # on the same CPUs, one timed pass each per round, who goes first alternating; each
    # pass's figure from its median step; the ratio of the medians over the rounds.
    go["duel"].write_text("go")
    rival_r = _result(rival, rd / "duel-shipped.json")
    c.say(_summary(rival_r))
    f.update(shipped_third_differ=_differing(rival_r, base))
    cpus = set(sorted(os.sched_getaffinity(0))[-4:])
    pinned = {name: _pin(child.pid, cpus) for name, child in (("duel-shipped", rival), ("pair-a", a))}
    turns = {"shipped": (rival, "duel-shipped"), "gpumemd": (a, "pair-a")}
    passes: dict[str, list[float]] = {"shipped": [], "gpumemd": []}
    parts: dict[str, list[dict[str, float]]] = {"shipped": [], "gpumemd": []}
    duel_differ = 0
    for i in range(args.duel_rounds):
        for mode in (("shipped", "gpumemd") if i % 2 == 0 else ("gpumemd", "shipped")):
            child, name = turns[mode]
            (duel_dir / f"{name}.{i}.go").write_text("go")
            r = _result(child, duel_dir / f"{name}.{i}.json", 60)
            passes[mode].append(round(r["step_tok_s"]))
            parts[mode].append(r["step_parts_ms"])
            duel_differ += r["differ"]
    (duel_dir / "stop").write_text("stop")
    shipped_median, gpumemd_median = c.median(passes["shipped"]), c.median(passes["gpumemd"])
    c.say(f"decode in turns (tok/s from each pass's median step): shipped {passes['shipped']}, gpumemd {passes['gpumemd']}")
    f.update(decode_ratio=c.ratio(gpumemd_median, shipped_median), duel_shipped_tok_s=passes["shipped"],
             duel_gpumemd_tok_s=passes["gpumemd"], duel_cpus=sorted(cpus), duel_threads_pinned=pinned,
             duel_step_parts_ms={mode: {k: round(c.median([x[k] for x in parts[mode]]), 3) for k in ("run", "replay", "sampler")}
                                 for mode in parts},
             duel_passes_differ=duel_differ,
             repeat_differ={r["name"]: r["repeat_differ"] for r in (base, half_r, solo_r, a_r, b_r)},
             nonfinite_logit_rows={r["name"]: r["nonfinite_logit_rows"] for r in (base, half_r, solo_r, a_r, b_r, rival_r)})
    t.update(pair_blocks=f">= {half_r['blocks']} each")
    result.ok = (
        f["kv_blocks_ratio"] >= 1.05 and f["tokens_identical"] and f["decode_ratio"] >= 0.98 and f["extra_startup_s"] <= 0.5
        and min(f["pair_blocks"]) >= half_r["blocks"] and f["pair_tokens_identical"] and f["reclaim_ms"] <= 100
        and f["survivor_same_tokens"] and f["sampler_peak_drop_fraction"] >= 0.95
    )


def _keep_logs(rd: Path, to: Path) -> None:
    to.mkdir(parents=True, exist_ok=True)
    for log in rd.glob("*.log"):
        shutil.copy(log, to / log.name)


def _differing(x: dict[str, Any], y: dict[str, Any]) -> dict[str, Any]:
    """How two engines' completions of the batch differ: the sequences that differ, the
    first (sequence, token) where one does and each run's top-1/top-2 logit gap at that
    step (a gap near 0 is a near-tie: a last-bit difference flips it), and over every step
    both runs took from the same tokens, how many gaps were equal to the bit (all: the
    logits were computed alike) and how many were exact ties; how many steps from the
    first had logits with equal bit checksums; and over the sequences that differ, the
    widest split: the two runs' gaps added at the step they parted (what the logits must
    have moved by; numeric noise parts runs at near-ties only, a corruption anywhere)."""
    a, b = x["tokens"], y["tokens"]
    ga, gb = x.get("margins"), y.get("margins")
    rows = [i for i, (u, v) in enumerate(zip(a, b)) if u != v]
    out: dict[str, Any] = {"sequences": differing(a, b), "first": None}
    if ga is None or gb is None:
        return out
    equal = steps = ties = 0
    for i, (u, v) in enumerate(zip(a, b)):
        split = parting_point(u, v)
        if rows and i == rows[0]:
            out["first"] = [i, split]
            if split < min(len(ga[i]), len(gb[i])):
                out["first_gaps"] = [ga[i][split], gb[i][split]]
        for j in range(min(split + 1, len(ga[i]), len(gb[i]))):  # step j saw the same tokens before it in both
            steps += 1
            equal += ga[i][j] == gb[i][j]
            ties += ga[i][j] == 0
    ca, cb = x.get("checksums") or [], y.get("checksums") or []
    same_steps = parting_point(ca, cb)
    splits = [ga[i][j] + gb[i][j] for i in rows for j in [parting_point(a[i], b[i])] if j < min(len(ga[i]), len(gb[i]))]
    out.update(gaps_equal=equal, gaps_compared=steps, ties=ties, steps_alike=same_steps, steps=max(len(ca), len(cb)),
               widest_split=max(splits, default=None))
    return out


def _pin(pid: int, cpus: set[int]) -> int:
    """Every thread of process ``pid`` onto ``cpus`` (best effort); how many were."""
    done = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
            done += 1
        except (OSError, ValueError):
            pass
    return done


def _eager_differ(x: dict[str, Any], y: dict[str, Any]) -> int | None:
    """Sequences whose eager (masked) A/B completions differ between two engines."""
    ta, tb = (r.get("attention_ab", {}).get("tokens") for r in (x, y))
    if ta is None or tb is None:
        return None
    return differing(ta, tb)


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
    pending = [cache.send_capture_done(max_blocks=256) for cache in caches]
    blocks = [handle.wait() for handle in pending]
    result.figures.update(grow_ms_median=c.median(grows), grows=usage.grows, committed=usage.committed, trimmed_bytes=trimmed,
                          round_blocks=blocks, round_ms=(time.perf_counter() - started) * 1000)
    result.targets.update(grows=8, round_blocks=[256, 256])
    result.ok = usage.grows == 8 and blocks == [256, 256]


def main() -> int:
    parser = c.ArgumentParser(BENCH, description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["cuda", "host"], default="cuda")
    parser.add_argument("--engine", choices=ENGINES, default="nanovllm", help="the engine the CUDA run measures (KITS)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--duel-rounds", type=int, default=8, help="decode passes each, in turns (CUDA)")
    parser.add_argument("--keep-logs", type=Path, default=None, help="copy every process's log here (CUDA)")
    parser.add_argument("--headroom-mib", type=int, default=None, help="each engine's round headroom (default: the integration's)")
    args = parser.parse_args()
    c.ensure_importable()
    if args.backend == "host":  # no engine runs on host: the line says so rather than name one
        return c.run(BENCH, args.backend, host, labels={"engine": "none (host: the engine API's pieces)"})
    labels = {"engine": args.engine}
    if args.engine == "transformers":  # its own processes and baselines: bench/transformers_kit.py
        import transformers_kit

        return c.run(BENCH, args.backend, lambda result, cleanup: transformers_kit.cuda(result, cleanup, args), labels=labels)
    return c.run(BENCH, args.backend, lambda result, cleanup: cuda(result, cleanup, args), labels=labels)


if __name__ == "__main__":
    sys.exit(main())
