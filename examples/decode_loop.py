#!/usr/bin/env python3
"""Two engines on one GPU, their KV pools sized after graph capture by one gpumemd round.

Each engine process is a toy decoder (random weights, nothing downloaded):

1. declares a KV pool with a K and a V buffer per layer (``--layers`` of them), lays
   the buffers out as tensors on virtual-only space, backed by a placeholder, and joins
   the device's commit round early, saying how many engines the round should gather
   (so an engine that starts late still shares the round);
2. captures its decode-step graph, which writes the step's keys and values into the KV
   cache with a device memcpy (a staging row block) and a scatter, then attends over a
   window of cached rows. A memcpy cannot be captured on unmapped space; on the
   placeholder it can;
3. reports capture-done with its headroom and graph memory, and waits for the round;
4. once the round commits, its KV holds real memory at the same addresses: it replays
   the captured graph for ``--steps`` steps and checks, after every step, that the keys
   and values landed where they should and the output matches an eager computation.

Run (a daemon must serve the device; ``--start-daemon`` starts a private one):

    python examples/decode_loop.py --start-daemon              # two engines, 32 layers
    python examples/decode_loop.py engine --name engine-a      # one engine, daemon running

The last line of each engine is a JSON summary; the launcher prints both and exits
non-zero if either engine failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GiB = 1 << 30
MiB = 1 << 20


def engine(args: argparse.Namespace) -> int:
    import torch

    import gpumem
    from gpumem_shared.protocol import to_wire

    torch.manual_seed(args.seed)
    device = torch.device("cuda", 0)
    heads, head_dim, hidden, batch = args.heads, args.head_dim, args.heads * args.head_dim, args.batch
    row_bytes = heads * head_dim * 2  # fp16

    session = gpumem.connect(0, name=args.name)
    layers = [
        {name: torch.randn(hidden, hidden, device=device, dtype=torch.float16) / hidden**0.5 for name in ("q", "k", "v", "o")}
        for _ in range(args.layers)
    ]
    buffers = [gpumem.KvBuffer(f"{kind}{layer}", row_bytes, align=256) for layer in range(args.layers) for kind in "kv"]
    pool = session.declare_kv_pool(f"{args.name}-kv", buffers, max_tokens=args.max_tokens)
    cache = {b.name: pool.tensor(b.name, torch.float16, (heads, head_dim)) for b in buffers}
    pool.placeholder()
    joined = pool.join_round(expect=args.expect)

    # Static inputs of the decode step, refilled before every replay: the tokens' hidden
    # states, the rows they write, the rows they attend over.
    x = torch.randn(batch, hidden, device=device, dtype=torch.float16)
    positions = torch.zeros(batch, dtype=torch.long, device=device)
    window = torch.zeros(args.window, dtype=torch.long, device=device)

    def step() -> torch.Tensor:
        h = x
        for layer, w in enumerate(layers):
            h = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)  # keeps fp16 in range
            q = (h @ w["q"]).view(batch, heads, head_dim)
            k = (h @ w["k"]).view(batch, heads, head_dim)
            v = (h @ w["v"]).view(batch, heads, head_dim)
            kc, vc = cache[f"k{layer}"], cache[f"v{layer}"]
            kc[:batch].copy_(k)  # staging rows: a device-to-device memcpy node
            vc[:batch].copy_(v)
            kc.index_copy_(0, positions, k)  # and a scatter to the tokens' rows
            vc.index_copy_(0, positions, v)
            keys = kc.index_select(0, window)  # (window, heads, head_dim)
            values = vc.index_select(0, window)
            scores = torch.einsum("bhd,whd->bhw", q.float(), keys.float()) / head_dim**0.5
            attn = torch.einsum("bhw,whd->bhd", scores.softmax(-1), values.float()).to(torch.float16)
            h = (attn.reshape(batch, hidden) @ w["o"]) + h
        return h

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up (cuBLAS workspaces, kernels) on the placeholder
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    free_before = torch.cuda.mem_get_info()[0]
    with torch.cuda.graph(graph, stream=stream):
        out = step()
    torch.cuda.synchronize()
    graph_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])

    print(f"{args.name}: captured on placeholder ({graph_bytes >> 20} MiB of graph memory) in round {joined.round_id}", flush=True)
    tokens = pool.capture_done(
        headroom_bytes=args.headroom,
        graph_pool_bytes=graph_bytes,
        min_tokens=args.min_tokens,
        weight=args.weight,
        timeout=args.round_wait,
    )
    print(f"{args.name}: round {pool.round_id} gave {tokens} tokens ({tokens * pool.bytes_per_token >> 20} MiB of KV)", flush=True)

    # Serve: every step writes `batch` new tokens, attends over the latest rows.
    ok = True
    for t in range(args.steps):
        base = batch + (t * batch) % (tokens - 2 * batch)
        positions.copy_(torch.arange(base, base + batch, device=device))
        window.copy_(torch.arange(base + batch - args.window, base + batch, device=device).clamp(min=batch))
        x.copy_(torch.randn(batch, hidden, device=device, dtype=torch.float16))
        graph.replay()
        torch.cuda.synchronize()
        # The first layer's keys went to the right rows of real memory...
        h0 = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        k0 = (h0 @ layers[0]["k"]).view(batch, heads, head_dim)
        if not torch.equal(cache["k0"][positions], k0):
            ok = False
            print(f"{args.name}: step {t}: layer-0 keys did not land in rows {base}..{base + batch}", flush=True)
            break
        # ...and the graph's output matches an eager run over the same cache.
        if t % 10 == 0:
            eager = step()
            if not (torch.isfinite(out).all() and torch.allclose(eager.float(), out.float(), atol=5e-2, rtol=5e-2)):
                ok = False
                print(f"{args.name}: step {t}: graph output differs from eager", flush=True)
                break
    summary = {
        "engine": args.name,
        "ok": ok,
        "tokens": tokens,
        "kv_bytes": pool.arena.committed,
        "bytes_per_token": pool.bytes_per_token,
        "buffers": len(buffers),
        "graph_pool_bytes": graph_bytes,
        "round": pool.round_id,
        "budget": to_wire(pool.budget),
        "steps": args.steps,
    }
    print(json.dumps(summary), flush=True)
    del graph
    session.close()
    return 0 if ok else 1


def launcher(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    daemon = None
    runtime = None
    if args.start_daemon:
        runtime = tempfile.mkdtemp(prefix="gpumemd-example-", dir="/tmp")
        env["GPUMEMD_RUNTIME_DIR"] = runtime
        daemon = subprocess.Popen([sys.executable, "-m", "gpumemd", "--device", "0", "--runtime-dir", runtime], env=env)
        deadline = time.monotonic() + 60
        while not Path(runtime, "gpu0.json").exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                print("decode_loop: gpumemd did not start", file=sys.stderr)
                return 1
            time.sleep(0.05)
    try:
        names = [f"engine-{chr(ord('a') + i)}" for i in range(args.engines)]
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "engine", "--name", name, "--layers", str(args.layers), "--weight", str(1 + i),
                 "--steps", str(args.steps), "--seed", str(i), "--expect", str(args.engines)],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for i, name in enumerate(names)
        ]
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=600)
            sys.stdout.write(out)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            results.append(json.loads(lines[-1]) if lines and proc.returncode == 0 else {"ok": False})
        ok = all(r.get("ok") for r in results)
        print(json.dumps({"engines": len(results), "ok": ok, "tokens": [r.get("tokens") for r in results]}), flush=True)
        return 0 if ok else 1
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", choices=["launch", "engine"], default="launch")
    parser.add_argument("--name", default="engine-a")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--start-daemon", action="store_true")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=1 << 20)
    parser.add_argument("--min-tokens", type=int, default=4096)
    parser.add_argument("--headroom", type=int, default=2 * GiB)
    parser.add_argument("--weight", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--expect", type=int, default=1, help="pools the round gathers before it commits")
    parser.add_argument("--round-wait", type=float, default=600.0, help="seconds to wait for the round to commit")
    args = parser.parse_args()
    return engine(args) if args.mode == "engine" else launcher(args)


if __name__ == "__main__":
    sys.exit(main())
