#!/usr/bin/env python3
"""Failover: kill -9 of a serving engine, and its standby's first token (issue 26).

A primary engine serves prompts with shared prefixes (``--prefixes`` prefixes of
``--prefix-blocks`` blocks, ``--per-prefix`` prompts each, every prompt one token past a
block boundary), keeping its KV cache and a prefix directory for a retain group; a
standby on the same device maps the primary's weights through a read-only grant,
reserves the group's windows and builds its KV arrays there (gpumem.standby), and waits.
The primary serves every prompt (phase 1), then starts on the same prompts again (phase
2) and is killed with -9 after its first phase-2 step. The standby adopts the KV pool and
the directory, seeds its prefix cache from the directory's trusted entries and serves
phase 2.

Figures: kill -> the standby's first token, and on the way (``kill_to_*_s``): adopt
returned, woke (what the standby put to sleep is back; ``wake_s`` from the adoption),
seeded (the block manager sized and seeded: it may step), first step started, first
token (``first_step_s``: the first step alone); the share of phase 2's prompt tokens
(every prompt served before) whose KV came from the adopted cache; the standby's own
memory before promotion (what it owns on the device: committed and placeholder bytes;
the weights it maps are the primary's; ``standby_host_bytes``: the host buffers of what
it put to sleep, its graphs arena; ``standby_model_arena_live``, nano-vllm: what lived
in the model arena it dropped, from torch's snapshot); whether its token ids equal the
primary's phase-1 ids for the same prompts (on CUDA the ids of the primary's second pass over them, their full blocks from
its prefix cache as the standby's are), up to near-ties on CUDA: where the two part, the
best logit must have led by at most ``token_margins.TIE_GAP`` in both (on the H200 the
standby's ids differed from the primary's second pass; whether at near-ties was not
recorded then); and the accounting once the standby closed (nothing left, no retain
group).

``--kill-daemon``: the same failover with gpumemd killed once during it. gpumemd runs
under tests/integration/fdstore_kit.py's stand-in for systemd's fd store (as
bench/restart.py does); it is frozen (SIGSTOP) before the primary's kill -9 and killed
-9 right after it, so it never sees the primary end, and started again from the store
at once, while the primary's process is still being torn down (``kill_to_primary_reaped_s``
says when it was gone). The restarted daemon finds the primary's session in its record,
holds the group for it until its process is gone and fenced, then orphans the group;
the standby, which waited in ``adopt`` across the restart, adopts. The first token's
time includes the restart; figures add kill -> the new daemon's READY=1 and its
generation.

Engines (bench/failover_engines.py): ``--backend host`` runs stand-ins (nano-vllm's
scheduler, block manager and prefix cache in miniature over real host memory, compute
as sleeps); ``--backend cuda`` runs nano-vllm (bench/nanovllm_kit.py's random-weight
Qwen3, greedy; gpumem.integrations.nanovllm with ``retain=`` and ``weights_to=`` on the
primary, ``standby=`` and ``share_weights=True`` on the standby), whose standby maps the
primary's model arena read-only and builds its model on it (no weights of its own),
rehearses serving on its placeholder and puts its own memory to sleep before it waits
(gpumem.port.takeover).
``standby_shared_weights_bytes`` is what the standby maps of the primary's (its weights
arena; nano-vllm: its parameters and buffers). ``--engine transformers`` runs
transformers' continuous batching instead (bench/transformers_kit.py's random-weight
Qwen3 in float32; gpumem.integrations.transformers with ``retain=`` on the primary,
``standby=`` on the standby, which builds its own weights: transformers' integration shares
none, so its standby puts them to sleep with its graphs while it waits); its tokens
must not part at all (transformers gives no logit gaps).

    python bench/failover.py --backend host [--kill-daemon]
    python bench/failover.py --backend cuda [--kill-daemon] [--engine transformers]

Last line: {"bench": "failover", "engine": ..., ...}; ok when kill -> first token <= 1.0 s, >= 99% of the
prompt tokens hit, the standby's own memory <= 1 GiB, the tokens identical (up to
near-ties on CUDA) and the accounting exact.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common as c
from token_margins import TIE_GAP, parting_gaps

BENCH = "failover"
GiB = 1 << 30
ENGINES = str(Path(__file__).resolve().parent / "failover_engines.py")
# The engines whose model directory is built once, offline, by their kit (transformers'
# engines build their random-weight model in their own processes).
MODEL_KITS = {"nanovllm": str(Path(__file__).resolve().parent / "nanovllm_kit.py")}
# Per backend: tokens a KV block (the stand-in's, nano-vllm's) and the defaults of the
# prompt shape; on CUDA a prompt and its new tokens stay within the kit's max_model_len.
SHAPES = {
    "host": {"block": 16, "prefixes": 8, "prefix_blocks": 8, "per_prefix": 4, "suffix_blocks": 8, "new_tokens": 24},
    "cuda": {"block": 256, "prefixes": 4, "prefix_blocks": 2, "per_prefix": 4, "suffix_blocks": 1, "new_tokens": 16},
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = c.ArgumentParser(BENCH, description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["host", "cuda"], default="host", help="daemon backend (default: host)")
    ap.add_argument("--engine", choices=["nanovllm", "transformers"], default="nanovllm",
                    help="the engine of the CUDA run (failover_engines.ROLES; the host runs stand-ins)")
    ap.add_argument("--prefixes", type=int, default=None, help="distinct shared prefixes (default: 8 host, 4 cuda)")
    ap.add_argument("--prefix-blocks", type=int, default=None, help="blocks each shared prefix fills (default: 8 host, 2 cuda)")
    ap.add_argument("--per-prefix", type=int, default=None, help="prompts per prefix (default: 4)")
    ap.add_argument("--suffix-blocks", type=int, default=None, help="blocks of each prompt's own tokens, plus one token (default: 8 host, 1 cuda)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens each request generates (default: 24 host, 16 cuda)")
    ap.add_argument("--kill-daemon", action="store_true", help="kill gpumemd -9 during the failover and restart it from its fd store")
    ap.add_argument("--blocks", type=int, default=4096, help="the KV pool's blocks (default: 4096)")
    ap.add_argument("--seed", type=int, default=26, help="prompt seed (default: 26)")
    ap.add_argument("--target-first-token-s", type=float, default=1.0, help="ok when kill -> first token <= this (default: 1.0)")
    ap.add_argument("--target-hit", type=float, default=0.99, help="ok when this share of prompt tokens hit (default: 0.99)")
    ap.add_argument("--target-standby-bytes", type=int, default=GiB, help="ok when the standby owns <= this before promotion (default: 1 GiB)")
    ap.add_argument("--start-timeout", type=float, default=120.0, help="seconds the daemon and the engines get to start")
    ap.add_argument("--run-timeout", type=float, default=300.0, help="seconds each phase may take")
    ap.add_argument("--logs", type=Path, default=None, help="copy the daemon's and the engines' logs into this directory at the end")
    args = ap.parse_args(argv)
    for name, value in SHAPES[args.backend].items():
        if getattr(args, name, 0) is None:
            setattr(args, name, value)
    if min(args.prefixes, args.prefix_blocks, args.per_prefix, args.new_tokens) < 1 or args.suffix_blocks < 0:
        ap.error("--prefixes, --prefix-blocks, --per-prefix and --new-tokens must be >= 1, --suffix-blocks >= 0")
    return args


def requests(args: argparse.Namespace, block: int, vocab: int) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    out = []
    for p in range(args.prefixes):
        prefix = [rng.randrange(vocab) for _ in range(args.prefix_blocks * block)]
        for i in range(args.per_prefix):
            own = [rng.randrange(vocab) for _ in range(args.suffix_blocks * block + 1)]
            out.append({"id": p * args.per_prefix + i, "prompt": prefix + own, "max_tokens": args.new_tokens})
    return out


def _keep_logs(rdir: Path, into: Path) -> None:
    """The run's logs (the daemon's, timestamped to the millisecond, and each engine's),
    for a failover's timeline past what the figures say."""
    into.mkdir(parents=True, exist_ok=True)
    for log in rdir.glob("*.log"):
        shutil.copyfile(log, into / log.name)


def wait_file(path: Path, child: c.Child, timeout: float, what: str) -> dict[str, Any]:
    child.wait_for(path.exists, timeout, what)
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def body(args: argparse.Namespace, result: c.Result, cleanup: contextlib.ExitStack) -> None:
    result.targets = {
        "first_token_s_max": args.target_first_token_s, "prompt_hit_min": args.target_hit,
        "standby_own_bytes_max": args.target_standby_bytes, "sequences_parting_at_a_clear_margin": 0, "accounting_exact": True,
    }
    import failover_engines as fe

    rdir = cleanup.enter_context(c.runtime_dir("gmb-failover-"))
    if args.logs is not None:  # registered after the runtime dir: runs before it goes
        cleanup.callback(_keep_logs, rdir, args.logs)
    work = rdir / "engines"
    work.mkdir(mode=0o700)
    daemon_args = ["--host-capacity", str(8 * GiB)]
    service: Any = None
    if args.kill_daemon:
        sys.path.insert(0, str(c.REPO / "tests" / "integration"))
        from fdstore_kit import Restartable

        service = Restartable(rdir, args.backend, daemon_args, c.child_env())
        cleanup.callback(service.close)
        service.start(wait=False)
        service.manager.wait_ready(args.start_timeout)
        c.say(f"gpumemd pid {service.pid} under the fd-store stand-in; its log: {service.manager.log_path}")
    else:
        daemon = c.Daemon(rdir, args.backend, 0, daemon_args)
        cleanup.callback(daemon.stop)
        daemon.wait_ready(args.start_timeout)

    import gpumem

    env = c.child_env(GPUMEMD_RUNTIME_DIR=str(rdir))
    block = SHAPES[args.backend]["block"]
    reqs = requests(args, block, fe.VOCAB)
    prompt_tokens = sum(len(r["prompt"]) for r in reqs)
    c.say(f"{BENCH}: {len(reqs)} prompts of {len(reqs[0]['prompt'])} tokens ({args.prefixes} shared prefixes of "
          f"{args.prefix_blocks * block}), {args.new_tokens} new tokens each; runtime dir {rdir}")
    spec: dict[str, Any] = {"backend": args.backend, "engine": args.engine, "runtime_dir": str(rdir), "group": "fo", "dir": str(work),
                            "blocks": args.blocks, "requests": reqs}
    if args.backend == "cuda" and args.engine in MODEL_KITS:
        spec["model"] = str(rdir / "model")
        subprocess.run([sys.executable, MODEL_KITS[args.engine], "build", spec["model"]], check=True, timeout=args.start_timeout, env=env)
    for port, role in ((29621, "primary"), (29622, "standby")):  # nano-vllm's process group, one each
        (work / f"{role}.spec.json").write_text(json.dumps(spec | {"role": role, "port": port}))
    engines = {}
    for role in ("primary", "standby"):
        engines[role] = c.Child(f"{role} engine", [ENGINES, str(work / f"{role}.spec.json")], rdir / f"{role}.log", env)
        cleanup.callback(engines[role].stop)
    ready = wait_file(work / "standby-ready.json", engines["standby"], args.run_timeout, "its reservation")

    session = gpumem.connect(0, name="bench-failover", runtime_dir=rdir)
    cleanup.callback(session.close)
    s = session.status()
    own = sum(a.committed + a.placeholder_bytes for a in s.arenas if a.owner == "fo-standby")
    attached = sum(a.committed for a in s.arenas if a.owner == "fo-primary" and "fo-standby" in a.attached)
    shared = ready["shared_weights_bytes"]
    parts = ", ".join(f"{a.name} {(a.committed + a.placeholder_bytes) / 2**20:.0f} MiB" for a in s.arenas if a.owner == "fo-standby")
    # What it put to sleep (nano-vllm: its graph pool kept in host memory, its model arena dropped)
    sleepers = [z for z in s.sleepers if z.owner == "fo-standby"]
    host = sum(z.host_bytes for z in sleepers)
    wakes = sum(z.committed_bytes for z in sleepers if z.asleep)
    slept = ", ".join(f"{z.arena} {z.committed_bytes / 2**20:.0f} MiB ({z.kept_bytes / 2**20:.0f} kept)" for z in sleepers if z.asleep) or "nothing"
    c.say(f"standby before promotion: owns {own / 2**20:.0f} MiB on the device ({parts}), {host / 2**20:.0f} MiB of host "
          f"buffers; asleep: {slept}; maps {shared / 2**20:.0f} MiB of the primary's weights (attached to "
          f"{attached / 2**20:.0f} MiB of its arenas)")
    live = ready.get("model_arena_live")
    if live is not None and "error" in live:
        c.say(f"standby's model arena: no figures ({live['error']})")
    elif live is not None:
        c.say(f"standby's model arena (dropped while asleep): {live['blocks']} blocks in use, {live['bytes'] / 2**20:.1f} MiB; "
              f"{live['graph_vars']} of the {live['graph_vars_expected']} graph inputs/outputs; others "
              f"{live['other_bytes'] / 2**20:.1f} MiB, sizes {live['other_sizes']}")

    phase1 = wait_file(work / "phase1.json", engines["primary"], args.run_timeout, "serving phase 1")
    started = wait_file(work / "phase2.json", engines["primary"], args.run_timeout, "its first phase-2 step")
    if service is not None:
        os.kill(service.pid, signal.SIGSTOP)  # it must not see the primary end before it dies
    os.kill(engines["primary"].pid, signal.SIGKILL)
    killed = time.monotonic()
    if service is not None:
        # Right away, not once the primary is reaped: the new daemon starts while the
        # primary's process (its CUDA context) is still being torn down, and must fence it.
        service.kill()  # -9: a stopped process dies too
        service.start(wait=False)  # with what the store kept
    engines["primary"].proc.wait(10)
    reaped = time.monotonic() - killed
    c.say(f"primary killed -9 {1e3 * (killed - started['at']):.1f} ms after its first phase-2 step, reaped {1e3 * reaped:.1f} ms after the kill")
    restarted: dict[str, Any] = {}
    if service is not None:
        service.manager.wait_ready(args.start_timeout)
        restarted = {"kill_to_daemon_ready_s": time.monotonic() - killed}
        c.say(f"gpumemd killed -9 and restarted from its fd store: ready {1e3 * restarted['kill_to_daemon_ready_s']:.1f} ms after the primary's kill")
    got = wait_file(work / "standby.json", engines["standby"], args.run_timeout, "serving phase 2")
    first_s = got["first_token_at"] - killed
    hit = got["cached"] / prompt_tokens
    # Where the standby's tokens part from the primary's, the lead of the best logit there
    # (nano-vllm records it; the host's stand-ins record none: any parting counts).
    margins_path = work / "phase1-margins.json"
    primary_margins = json.loads(margins_path.read_text()) if margins_path.exists() else {}
    parted = parting_gaps(phase1, got["tokens"], primary_margins, got.get("margins", {}))
    clear = sum(gap > TIE_GAP for gap in parted)
    identical = got["tokens"] == phase1
    timeline = {key: got[f"{key}_at"] - killed for key in ("adopted", "woke", "seeded", "first_step", "first_token")}
    c.say("kill -> " + ", ".join(f"{key.replace('_', ' ')} {1e3 * at:.1f} ms" for key, at in timeline.items())
          + f" (wake {1e3 * (got['woke_at'] - got['adopted_at']):.1f} ms, first step {1e3 * (got['first_token_at'] - got['first_step_at']):.1f} ms)")
    c.say(f"{got['trusted']} directory entries trusted ({got['corrupt']} corrupt); prompt tokens from the adopted KV "
          f"{got['cached']}/{prompt_tokens} ({100 * hit:.2f}%); tokens {'identical' if identical else 'DIFFER'} to the primary's"
          + ("" if identical else f" in {len(parted)} of {len(phase1)} requests, {clear} where the best logit led by more than "
             f"{TIE_GAP:g} (largest lead where one parted: {max(parted):.4g})"))

    (work / "close.json").write_text("{}")
    engines["standby"].proc.wait(args.run_timeout)
    deadline = time.monotonic() + 10
    while True:
        s = session.status()
        exact = s.device.accounted_bytes == 0 and not s.arenas and not s.retained
        if exact or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    c.say(f"after the standby closed: accounted {s.device.accounted_bytes} bytes, {len(s.arenas)} arenas, {len(s.retained)} retain groups")
    if service is not None:
        restarted["daemon_generation"] = s.daemon.generation
        exact = exact and s.daemon.generation == 1  # the daemon that ends it is the restarted one, with its state
    result.figures = {
        **{f"kill_to_{key}_s": at for key, at in timeline.items()}, "wake_s": got["woke_at"] - got["adopted_at"],
        "first_step_s": got["first_token_at"] - got["first_step_at"], "prompt_hit": hit,
        "prompt_tokens": prompt_tokens, "prompt_tokens_hit": got["cached"], "directory_trusted": got["trusted"],
        "directory_corrupt": got["corrupt"], "standby_own_bytes": own, "standby_host_bytes": host, "standby_wake_bytes": wakes,
        "standby_asleep": ready.get("asleep", []), "standby_model_arena_live": live, "standby_shared_weights_bytes": shared,
        "tokens_identical": identical, "sequences_differing": len(parted), "sequences_parting_at_a_clear_margin": clear,
        "accounting_exact": exact, "daemon_killed": args.kill_daemon, "kill_to_primary_reaped_s": reaped, **restarted,
    }
    result.ok = (first_s <= args.target_first_token_s and hit >= args.target_hit and own <= args.target_standby_bytes
                 and clear == 0 and exact)


def main(argv: list[str] | None = None) -> int:
    c.ensure_importable()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    engine = "none (host: stand-ins)" if args.backend == "host" else args.engine  # as bench/engine.py's line says on the host
    return c.run(BENCH, args.backend, lambda result, cleanup: body(args, result, cleanup), labels={"engine": engine})


if __name__ == "__main__":
    sys.exit(main())
