#!/usr/bin/env python3
"""transformers' continuous batching, as shipped and on gpumemd (gpumem.integrations.transformers),
on random-weight models built offline from transformers' own config classes; shared by
bench/engine.py (``--engine transformers``), the transformers engines of bench/burst.py,
bench/sleep.py and bench/failover.py (``--engine transformers``: bench/burst_engines.py,
bench/sleep_engines.py, bench/failover_engines.py) and tests/integration/test_transformers_gpu.py.

Models (``--arch``): ``qwen3`` (full attention, 8 KV heads of 16 query heads, head 128) and
``mistral`` (every layer sliding-window, 512 tokens, 4 KV heads of 16, head 64): the
second lays its KV out otherwise (another GQA ratio and head size, sliding groups,
transformers' decode fast path off). Prompts are token ids (seeded), no tokenizer; greedy.

    transformers_kit.py engine --mode plain|gpumemd --arch qwen3 --out run.json [...]
    bench/engine.py --engine transformers        # the figures of issue 36 (``cuda`` here)

An engine process writes JSON: ``blocks`` (usable KV blocks), ``startup_s`` (manager
made, warmed up and started), ``tokens`` (per prompt), ``decode_tok_s``, and with
``--sleep-cycle`` the tokens again after sleep and wake with the freed and woken bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import _common as c

ARCHS = ("qwen3", "mistral")
VOCAB = 32000  # build_model's: prompt ids must stay below it
PLAIN_PERCENT = 0.9  # transformers' max_memory_percent for greedy decoding (0.8 with logits processors)


def build_model(arch: str, *, dtype: Any = None, layers: int = 8) -> Any:
    """A random-weight model of ``arch`` on CUDA (seeded: the same weights every time)."""
    import torch
    from transformers import GenerationConfig, MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = {"vocab_size": VOCAB, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": layers,
              "num_attention_heads": 16, "max_position_embeddings": 8192, "attn_implementation": "sdpa"}
    if arch == "qwen3":
        model_cls, config = Qwen3ForCausalLM, Qwen3Config(num_key_value_heads=8, head_dim=128, **common)
    elif arch == "mistral":
        model_cls, config = MistralForCausalLM, MistralConfig(num_key_value_heads=4, head_dim=64, sliding_window=512, **common)
    else:
        raise ValueError(f"no model '{arch}': {', '.join(ARCHS)}")
    torch.manual_seed(0)
    model = model_cls(config).to("cuda", dtype or torch.bfloat16).eval()
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=64)
    return model


def prompts(count: int, *, seed: int = 1, low: int = 16, high: int = 200) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, 32000) for _ in range(rng.randrange(low, high))] for _ in range(count)]


def config(**options: Any) -> Any:
    """The ``ContinuousBatchingConfig`` every engine of the kit runs with (CUDA graphs asked
    for, plain and gpumemd alike), ``options`` its other fields."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(use_cuda_graph=True, **options)


def block_bytes(cache: Any) -> int:
    """One KV block's bytes over every layer, K and V."""
    return int(2 * len(cache.key_cache) * cache.block_size * cache.num_key_value_heads * cache.head_dim * cache.dtype.itemsize)


class Stream:
    """Requests streamed from a started manager: per request, when its first token came
    (``time.monotonic()`` when this saw it) and, once finished, its tokens. ``poll``
    takes what the generation thread put out since; a failed request, or the thread
    ended, raises."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.first_at: dict[str, float] = {}
        self.done: dict[str, list[int]] = {}

    def add(self, prompt: list[int], max_tokens: int, request_id: str | None = None) -> str:
        rid = self.manager.add_request(prompt, request_id=request_id, max_new_tokens=max_tokens, streaming=True)
        if rid is None:
            raise RuntimeError("transformers' manager took no request (not running, or stopping)")
        return str(rid)

    def poll(self, timeout: float) -> tuple[list[str], list[str]]:
        """(requests whose first token came, requests that finished) since the last poll,
        waiting at most ``timeout`` for the first output."""
        first, done = [], []
        while (out := self.manager.get_result(timeout=timeout)) is not None:
            timeout = 0.0  # then only what is there already
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            if out.generated_tokens and out.request_id not in self.first_at:
                self.first_at[out.request_id] = time.monotonic()
                first.append(out.request_id)
            if out.is_finished():
                self.done[out.request_id] = list(out.generated_tokens)
                done.append(out.request_id)
        if not self.manager.is_running():
            raise RuntimeError("transformers' generation thread is not running (its log says why)")
        return first, done


class Steps:
    """Each decode step's batch and seconds (every request in it computes one token),
    timed around the manager's ``_generation_step``: with SDPA's attention mask transformers
    batches synchronously, so the step ends with its outputs on the host. And the
    requests transformers evicted when its cache ran out (its offloading manager's
    count, the engine's preemptions)."""

    def __init__(self, manager: Any) -> None:
        self.decode: list[tuple[int, float]] = []
        self.evicted = 0
        processor, step, offload = manager.batch_processor, manager._generation_step, manager.batch_processor.offloading_manager.offload_requests

        def timed_step() -> None:
            batch = processor.inputs_and_outputs.requests_in_batch  # this step's (the next one makes a new list)
            started = time.perf_counter()
            step()
            took = time.perf_counter() - started
            if batch and all(f.query_length == 1 for f in batch):
                self.decode.append((len(batch), took))

        def counted_offload() -> int:
            evicted: int = offload()
            self.evicted += evicted
            return evicted

        manager._generation_step, processor.offloading_manager.offload_requests = timed_step, counted_offload


def generate(manager: Any, inputs: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    """Every prompt to its end; (tokens per prompt, generated tokens per second)."""
    started = time.perf_counter()
    ids = manager.add_requests(inputs=inputs, max_new_tokens=tokens)
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=60)
        if result is None:
            raise RuntimeError(f"no result within 60 s ({len(done)}/{len(ids)} done; running: {manager.is_running()})")
        if result.is_finished():
            if result.error:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            done[result.request_id] = list(result.generated_tokens)
    elapsed = time.perf_counter() - started
    return [done[i] for i in ids], sum(len(t) for t in done.values()) / elapsed


def engine(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from gpumem.integrations import transformers as gtf

    if args.mode == "gpumemd":
        options: dict[str, Any] = {"expect": args.expect, "runtime_dir": args.runtime_dir}
        if args.retain:
            options["retain"] = args.retain
        if args.standby:
            options["standby"] = (args.standby, Path(args.secret_file).read_text())
        gtf.enable(args.name, max_blocks=args.max_blocks, **options)
    if args.start_after:
        while not Path(args.start_after).exists():
            time.sleep(0.005)
    context_free = torch.cuda.mem_get_info()[0]  # the CUDA context made: what the device has free beside it
    started = time.perf_counter()
    model = build_model(args.arch, dtype=getattr(torch, args.dtype))
    cb = config(max_memory_percent=args.max_memory_percent, max_batch_tokens=args.max_batch_tokens, num_blocks=args.num_blocks)
    built = time.perf_counter()
    manager = model.init_continuous_batching(continuous_batching_config=cb)
    if args.sizing_only:
        # transformers' own sizing, before a warm-up that may not survive it: warmup() would
        # make this processor first (its cache sized then) and the manager has none before.
        processor = manager._create_batch_processor()
        return {"mode": args.mode, "arch": args.arch, "blocks": processor.cache.get_num_free_blocks()}
    manager.warmup()
    if args.standby:  # settled in warmup(); its manager starts once it took over
        print("STANDBY READY", flush=True)
        took = gtf.port().take_over(wait=args.take_over_wait)
    manager.start()
    out: dict[str, Any] = {"mode": args.mode, "arch": args.arch, "startup_s": time.perf_counter() - built, "build_s": built - started}
    cache = manager.batch_processor.cache
    out["blocks"] = cache.get_num_free_blocks()
    out["block_bytes"] = block_bytes(cache)
    inputs = prompts(args.prompts, low=args.prompt_len // 2, high=args.prompt_len)
    if args.retain and args.secret_file:
        Path(args.secret_file).write_text(gtf.port().retain_secret())
    if args.standby:
        out["take_over"] = {"seeded": took.seeded, "trusted": took.trusted, "corrupt": took.corrupt}
    out["tokens"], out["decode_tok_s"] = generate(manager, inputs, args.tokens)
    if args.mode == "gpumemd":
        kv = gtf.port().mem.kv
        out["kv_rows_committed"] = kv.blocks if kv else 0
        out["blocks_after"] = gtf.port().adapter.count - 2
        out["memory"] = where_memory_went(manager, gtf.port())
        if args.retain:
            out["retain_secret_len"] = len(gtf.port().retain_secret())
    else:
        free, total = torch.cuda.mem_get_info()
        out["memory"] = {"context_bytes": total - context_free, "model_bytes": sum(t.numel() * t.element_size() for t in model.parameters()),
                         "torch_peak_reserved_bytes": torch.cuda.max_memory_reserved(), "device_total_bytes": total,
                         "max_memory_percent": manager.continuous_batching_config.max_memory_percent}
    if args.serve_until:
        print("SERVING", flush=True)
        while not Path(args.serve_until).exists():
            time.sleep(0.01)
        out["blocks_final"] = gtf.port().adapter.count - 2 if args.mode == "gpumemd" else out["blocks"]
    follower = gtf.port().follower if args.mode == "gpumemd" else None
    if follower is not None:
        f = follower.figures
        out["follow"] = {"grows": f.grows, "shrinks": f.shrinks, "blocks_moved": f.blocks_moved, "preempted": f.preempted}
    if args.sleep_cycle:
        free_before = torch.cuda.mem_get_info()[0]
        t = time.perf_counter()
        gtf.port().sleep("weights", "graphs", "kv", drop=["kv"])
        out["sleep_s"], out["freed_bytes"] = time.perf_counter() - t, torch.cuda.mem_get_info()[0] - free_before
        t = time.perf_counter()
        gtf.port().wake()
        out["wake_s"] = time.perf_counter() - t
        out["tokens_after_wake"], _ = generate(manager, inputs, args.tokens)
    manager.stop(block=True, timeout=30)
    return out


def pool_contents(arena: Any) -> dict[str, Any]:
    """What torch holds in an arena's pool: its segments' bytes, the bytes of tensors alive
    in them, and the largest of those (MiB): which tensors a ceiling row pays for."""
    import torch

    from gpumem.torch_support import pool_segments

    try:
        blocks = [b for seg in pool_segments(torch, arena.torch_pool().pool) for b in seg["blocks"]]
    except Exception as e:  # a diagnostic: the engine's figures go on without it, the reason with them
        return {"error": repr(e)}
    alive = sorted((b["size"] for b in blocks if b["state"] == "active_allocated"), reverse=True)
    return {"bytes": sum(b["size"] for b in blocks), "alive_bytes": sum(alive), "largest_alive_mib": [round(n / 2**20, 1) for n in alive[:8]]}


def where_memory_went(manager: Any, p: Any) -> dict[str, Any]:
    """An engine on gpumemd once serving: the layout's ceiling (transformers sizes its
    batch tensors, the attention mask among them, by it), what its arenas hold, what torch
    holds outside them and what the device has free: where a pair's share went."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return {"model_pool": pool_contents(p.mem.model), "graphs_pool": pool_contents(p.mem.graphs), "ceiling_blocks": p.adapter.ceiling, "max_batch_tokens": manager.continuous_batching_config.max_batch_tokens,
            "model_bytes": p.mem.model.committed, "graphs_bytes": p.mem.graphs.committed,
            "kv_bytes": p.mem.kv.pool.arena.committed if p.mem.kv else 0, "torch_reserved_bytes": torch.cuda.memory_reserved(),
            "torch_allocated_bytes": torch.cuda.memory_allocated(),
            "torch_peak_reserved_bytes": torch.cuda.max_memory_reserved(), "device_free_bytes": free, "device_total_bytes": total}


def half_percent(plain: dict[str, Any]) -> float:
    """The max_memory_percent at which a plain engine takes half the device, from one
    that ran at another (its ``memory``): its context and weights fixed, the rest
    transformers sizes in proportion to the percent. transformers' own solver undercounts
    warm-up's read of the cache, so an engine at 0.45 takes more than half (64 % of the
    H100: a 53.5 GB peak reserve and its 0.55 GB context, 2026-12-07)."""
    m = plain["memory"]
    sized = (m["torch_peak_reserved_bytes"] - m["model_bytes"]) / m["max_memory_percent"]
    return max(0.01, (m["device_total_bytes"] / 2 - m["context_bytes"] - m["model_bytes"]) / sized)


def cuda(result: Any, cleanup: Any, args: argparse.Namespace) -> None:
    """bench/engine.py --engine transformers: issue 36's figures, each against its
    same-run baseline, into ``result`` (bench/_common.Result). Every engine is a process
    of this kit; a pair starts at the same moment (a go file)."""
    rd = cleanup.enter_context(c.runtime_dir("gmb-tf-"))
    if getattr(args, "keep_logs", None):
        # gpumemd's sockets stay behind if it had to be killed: copytree fails on a socket.
        sockets = shutil.ignore_patterns("*.zmq", "*.fd")
        cleanup.callback(lambda: shutil.copytree(rd, args.keep_logs, dirs_exist_ok=True, ignore=sockets))
    common = ["--arch", getattr(args, "arch", "qwen3"), "--prompts", str(args.prompts), "--tokens", str(args.tokens)]

    def run(names: list[str], extra: list[str], go: str = "") -> list[dict[str, Any]]:
        children = [c.Child(n, [__file__, "engine", "--name", n, "--out", str(rd / f"{n}.json"), *common, *extra,
                                *(["--start-after", str(rd / go)] if go else [])], rd / f"{n}.log") for n in names]
        for child in children:
            cleanup.callback(child.stop)
        if go:
            time.sleep(5.0)  # both imported: the go file starts them at the same moment
            (rd / go).write_text("go")
        for child in children:  # each to its end, whatever its status (a plain engine may run out of memory)
            child.wait_for(lambda ch=child: ch.proc.poll() is not None, 600, "its batch")
        return [json.loads((rd / f"{n}.json").read_text()) if (rd / f"{n}.json").exists() else {"failed": ch.proc.returncode}
                for n, ch in zip(names, children)]

    # transformers' own sizing at its default max_memory_percent, read before its warm-up:
    # on the H100 an engine of that size ran out of memory in warm-up and its first batch
    # (2026-12-07), so tokens, decode and start-up are compared with the plain engine that
    # served, at the default or else at half of it.
    (sized,) = run(["plain-sized"], ["--mode", "plain", "--sizing-only"])
    (plain,) = run(["plain"], ["--mode", "plain"])
    (at45,) = run(["plain-45"], ["--mode", "plain", "--max-memory-percent", str(PLAIN_PERCENT / 2)])
    served = plain if "failed" not in plain else at45
    half = at45 if "failed" in at45 else run(["plain-half"], ["--mode", "plain", "--max-memory-percent", f"{half_percent(at45):.4f}"])[0]
    plain_pair = run(["plain-a", "plain-b"], ["--mode", "plain"], go="go-plain-pair")
    daemon = c.Daemon(rd, "cuda").wait_ready(60)
    cleanup.callback(daemon.stop)
    on = ["--mode", "gpumemd", "--runtime-dir", str(rd)]
    (solo,) = run(["solo"], [*on, "--expect", "1"])
    pair = run(["pair-a", "pair-b"], [*on, "--expect", "2"], go="go-pair")
    f = result.figures
    f.update(engine="transformers", blocks_plain=sized.get("blocks"), blocks_gpumemd=solo.get("blocks"),
             plain_default_served="failed" not in plain, baseline="plain" if served is plain else "plain-0.45",
             decode_tok_s_plain=served.get("decode_tok_s"), decode_tok_s_gpumemd=solo.get("decode_tok_s"),
             startup_plain_s=served.get("startup_s"), startup_gpumemd_s=solo.get("startup_s"),
             pair_blocks=[r.get("blocks", 0) for r in pair], half_plain_blocks=half.get("blocks"), plain_045_blocks=at45.get("blocks"), half_plain_memory=half.get("memory"),
             plain_pair_started=["failed" not in r for r in plain_pair], plain_pair_blocks=[r.get("blocks", 0) for r in plain_pair])
    f["memory_gpumemd"], f["memory_pair"] = solo.get("memory"), [r.get("memory") for r in pair]  # where the share went
    f["blocks_ratio"] = c.ratio(solo.get("blocks", 0), sized.get("blocks", 0))
    f["tokens_identical"] = "tokens" in solo and solo["tokens"] == served.get("tokens") and all(r.get("tokens") == served.get("tokens") for r in pair)
    f["decode_ratio"] = c.ratio(solo.get("decode_tok_s", 0.0), served.get("decode_tok_s", 0.0))
    f["startup_extra_s"] = solo.get("startup_s", 1e9) - served.get("startup_s", 0.0)
    f["pair_vs_half_plain"] = [c.ratio(r.get("blocks", 0), half.get("blocks", 0)) for r in pair]
    result.targets.update(blocks_ratio=1.05, tokens_identical=True, decode_ratio=0.98, startup_extra_s=0.5, pair_vs_half_plain=0.95)
    # A failed baseline has no blocks: c.ratio against 0 is inf, which must not meet a target.
    result.ok = ("blocks" in sized and "blocks" in half
                 and f["blocks_ratio"] >= 1.05 and f["tokens_identical"] and f["decode_ratio"] >= 0.98 and f["startup_extra_s"] <= 0.5
                 and all(r >= 0.95 for r in f["pair_vs_half_plain"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("command", choices=["engine"])
    parser.add_argument("--mode", choices=["plain", "gpumemd"], default="gpumemd")
    parser.add_argument("--arch", choices=ARCHS, default="qwen3")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--name", default="transformers")
    parser.add_argument("--runtime-dir", default=None)
    parser.add_argument("--expect", type=int, default=0)
    parser.add_argument("--retain", default="")
    parser.add_argument("--max-blocks", type=int, default=0)
    parser.add_argument("--max-memory-percent", type=float, default=None)
    parser.add_argument("--max-batch-tokens", type=int, default=2048, help="the same for every engine compared (the mask is M by pages)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--start-after", default="")
    parser.add_argument("--sleep-cycle", action="store_true")
    parser.add_argument("--num-blocks", type=int, default=None, help="ContinuousBatchingConfig.num_blocks (plain: fixed; gpumemd: the ceiling)")
    parser.add_argument("--prompt-len", type=int, default=200, help="prompts of half this to this many tokens")
    parser.add_argument("--serve-until", default="", help="after generating, keep the manager running until this file exists")
    parser.add_argument("--secret-file", default="", help="with --retain: write the secret here; with --standby: read it")
    parser.add_argument("--standby", default="", help="the retain group of the primary this engine stands by for")
    parser.add_argument("--take-over-wait", type=float, default=120.0)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--sizing-only", action="store_true", help="report the blocks the manager sized and stop (no warm-up)")
    parser.add_argument("--half-of", type=Path, help="plain at the max_memory_percent that takes half the device, from this plain run's output")
    args = parser.parse_args()
    if args.half_of:
        args.max_memory_percent = half_percent(json.loads(args.half_of.read_text()))
    result = c.exit_on_error(lambda: engine(args))
    if args.out:
        args.out.write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("tokens")}))
    os._exit(0)  # the manager's thread and gpumemd's session end with the process


if __name__ == "__main__":
    sys.exit(main())
