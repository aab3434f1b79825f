"""The engines of bench/burst.py, one per process: a stand-in on the host backend, on CUDA
the engine ``--engine`` names (``ENGINES``: nano-vllm, transformers' continuous batching),
each serving a seeded schedule of requests and writing what it measured.

    python bench/burst.py --serve SPEC.json          # run by bench/burst.py

SPEC (JSON): name, backend, engine, config (static | round | elastic | alone), blocks (static and
alone: the KV blocks the engine gets, no daemon), min_blocks, watermark, step,
runtime_dir, ready/go/schedule/out file paths, and on CUDA model and port. The engine
builds itself, writes ``ready`` ({"blocks"}), waits for ``go`` (the schedule's start,
CLOCK_MONOTONIC), reads ``schedule`` ([{"id", "at", "prompt", "max_tokens"}], ``at`` in
seconds from the start), serves it (a step whenever it has work; ``idle`` otherwise,
which answers the daemon's shrinks) and writes ``out``: per request the time to its first
token from its arrival (not for ``tail`` requests) and its token ids, each decode step's
batch and time, preemptions,
and what following the pool did (gpumem.port.blocks.Figures).

The stand-in is nano-vllm's scheduler and block manager in miniature (no prefix cache),
over a KV pool of two buffers (K and V, a block a row) in real memory: host memory from
the daemon, or NumPy's own for the static and alone configurations. Its "model" writes
each token's id into its slot of K and V and derives the next token from every slot of
the sequence read back through the block table, so a block moved wrong changes the
tokens; its compute is a sleep (``PREFILL_S_PER_TOKEN``, ``DECODE_S``) so that the
figures measure memory, not this machine's two cores.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import _common as c

BLOCK = 64  # tokens a block (stand-in)
SLOT = 1024  # bytes a token takes in K and in V (stand-in): a block row is 64 KiB
MAX_BLOCKS = 8192
VOCAB = 32768
MAX_NUM_SEQS = 256
MAX_BATCHED = 8192
PREFILL_S_PER_TOKEN = 4e-6
DECODE_S = 0.025
DECODE_S_PER_SEQ = 1e-4


# ---------------------------------------------------------------------- the stand-in


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []


class BlockManager:
    """nano-vllm's, without the prefix cache."""

    def __init__(self, blocks: int) -> None:
        self.block_size = BLOCK
        self.blocks = [Block(i) for i in range(blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: collections.deque[int] = collections.deque(range(blocks))
        self.used_block_ids: set[int] = set()

    def allocate(self, seq: Seq, blocks: int) -> None:
        for _ in range(blocks):
            i = self.free_block_ids.popleft()
            self.blocks[i].ref_count = 1
            self.used_block_ids.add(i)
            seq.block_table.append(i)

    def deallocate(self, seq: Seq) -> None:
        for i in seq.block_table:
            self.blocks[i].ref_count = 0
            self.used_block_ids.discard(i)
            self.free_block_ids.append(i)
        seq.block_table.clear()


class Seq:
    def __init__(self, rid: int, prompt: list[int], max_tokens: int) -> None:
        self.rid = rid
        self.token_ids = list(prompt)
        self.prompt_len = len(prompt)
        self.max_tokens = max_tokens
        self.block_table: list[int] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return -(-len(self.token_ids) // BLOCK)

    @property
    def completion(self) -> list[int]:
        return self.token_ids[self.prompt_len:]


def standin_adapter(engine: StandIn) -> Any:
    """nano-vllm's adapter to the engine port (the stand-in has its scheduler's and block
    manager's fields) with the stand-in's NumPy copy."""
    import types

    from gpumem.integrations.nanovllm import NanoVllm

    class Adapter(NanoVllm):
        def copy_blocks(self, src: list[int], dst: list[int]) -> None:
            engine._copy(src, dst)

    adapter = Adapter(None, Block, lambda n: n)
    adapter.scheduler = types.SimpleNamespace(block_manager=engine.manager, waiting=engine.waiting, running=engine.running)
    return adapter


class StandIn:
    """One engine: scheduler, block manager, KV rows, the token rule above."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import numpy

        self.np = numpy
        self.session: Any = None
        self.pool: Any = None
        self.follower: Any = None
        self.preempted = 0
        if spec["config"] in ("static", "alone"):
            blocks = spec["blocks"]
            self.k, self.v = (numpy.zeros((blocks, BLOCK * SLOT), numpy.uint8) for _ in range(2))
        else:
            import gpumem

            self.session = gpumem.connect(0, name=spec["name"], runtime_dir=spec["runtime_dir"], timeout=60.0)
            self.pool = self.session.declare_kv_pool(
                f"{spec['name']}-kv", [gpumem.KvBuffer(b, BLOCK * SLOT) for b in "kv"], max_tokens=MAX_BLOCKS
            )
            self.pool.join_round(expect=2)
            blocks = self.pool.capture_done(min_tokens=spec["min_blocks"], timeout=60)
            self.k, self.v = (numpy.asarray(self.pool.view(b)).reshape(MAX_BLOCKS, BLOCK * SLOT) for b in "kv")
        for rows in (self.k, self.v):
            rows[:blocks] = 0  # touched once now, as an engine's warm-up would: no page faults in the first burst
        # Each token's first 8 bytes of K and V as int64, through strided views: the token
        # rule reads a few bytes per slot, never whole rows.
        self.k64, self.v64 = (rows.reshape(-1, BLOCK, SLOT)[:, :, :8].view(numpy.int64)[:, :, 0] for rows in (self.k, self.v))
        self.manager = BlockManager(blocks)
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: collections.deque[Seq] = collections.deque()
        if spec["config"] == "elastic":
            from gpumem.port.blocks import BlockFollower

            self.follower = BlockFollower(self.pool, standin_adapter(self), watermark=spec["watermark"], step=spec["step"])

    @property
    def blocks(self) -> int:
        return len(self.manager.blocks)

    block_bytes = 2 * BLOCK * SLOT

    def _copy(self, src: list[int], dst: list[int]) -> None:
        for rows in (self.k, self.v):
            rows[dst] = rows[src]  # gathered first: sources and destinations never overlap

    def add(self, rid: int, prompt: list[int], max_tokens: int) -> None:
        self.waiting.append(Seq(rid, prompt, max_tokens))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def idle(self) -> None:
        if self.follower is not None:
            self.follower.idle()

    def step(self) -> tuple[list[int], dict[int, list[int]], int]:
        """One step: (requests whose first token came, finished requests' tokens, decode
        tokens (0 for a prefill step))."""
        if self.follower is not None:
            self.follower.before_step()
        seqs, prefill = self._schedule()
        started = time.perf_counter()
        self._write(seqs, prefill)
        for seq in seqs:
            seq.token_ids.append(self._next(seq))
        compute = PREFILL_S_PER_TOKEN * sum(map(len, seqs)) if prefill else DECODE_S + DECODE_S_PER_SEQ * len(seqs)
        time.sleep(max(0.0, compute - (time.perf_counter() - started)))
        first = [s.rid for s in seqs if len(s.completion) == 1]
        done = {}
        for seq in seqs:
            if len(seq.completion) >= seq.max_tokens:
                self.manager.deallocate(seq)
                self.running.remove(seq)
                done[seq.rid] = seq.completion
        return first, done, 0 if prefill else len(seqs)

    def _schedule(self) -> tuple[list[Seq], bool]:
        m, out, tokens = self.manager, [], 0
        while self.waiting and len(out) < MAX_NUM_SEQS:
            seq = self.waiting[0]
            if tokens + len(seq) > MAX_BATCHED or len(m.free_block_ids) < seq.num_blocks:
                break
            m.allocate(seq, seq.num_blocks)
            tokens += len(seq)
            out.append(self.waiting.popleft())
            self.running.append(seq)
        if out:
            return out, True
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted meanwhile
            while len(seq) % BLOCK == 1 and not m.free_block_ids:  # its last token starts a block
                victim = self.running.pop()
                m.deallocate(victim)
                self.waiting.appendleft(victim)
                self.preempted += 1
                if victim is seq:
                    break
            if seq in self.running:
                if len(seq) % BLOCK == 1:
                    m.allocate(seq, 1)
                out.append(seq)
        assert out, "nothing to schedule: the KV cache holds less than one request"
        return out, False

    def _write(self, seqs: list[Seq], prefill: bool) -> None:
        """K and V of the tokens the step computes: every token of a prefilled sequence,
        the last one of a decoding one; in one scatter for the batch."""
        np = self.np
        if prefill:
            pos = np.concatenate([np.arange(len(s)) for s in seqs])
            tables = np.concatenate([np.asarray(s.block_table)[np.arange(len(s)) // BLOCK] for s in seqs])
            ids = np.asarray([t for s in seqs for t in s.token_ids], np.int64)
        else:
            pos = np.asarray([len(s) - 1 for s in seqs])
            tables = np.asarray([s.block_table[(len(s) - 1) // BLOCK] for s in seqs])
            ids = np.asarray([s.token_ids[-1] for s in seqs], np.int64)
        self.k64[tables, pos % BLOCK] = ids
        self.v64[tables, pos % BLOCK] = 7 * ids + 1

    def _next(self, seq: Seq) -> int:
        np, n = self.np, len(seq)
        table = np.asarray(seq.block_table)
        k, v = self.k64[table].ravel()[:n], self.v64[table].ravel()[:n]
        return int(((k + 1) * np.arange(1, n + 1)).sum() * 31 + (v % 1009).sum() + n) % VOCAB

    def figures(self) -> dict[str, Any]:
        follow = dataclasses.asdict(self.follower.figures) if self.follower is not None else {}
        return {"blocks_end": self.blocks, "preempted": self.preempted, "follow": follow}

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


# ---------------------------------------------------------------------- nano-vllm


class Nano:
    """A nano-vllm engine (bench/nanovllm_kit.py's model and stand-ins): as shipped with a
    fixed block count (static, alone), or on gpumemd (round, elastic)."""

    @staticmethod
    def build(work: Path) -> Path:
        """The model directory every engine of the run loads (built once, offline)."""
        import subprocess

        model = work / "model"
        subprocess.run([sys.executable, str(Path(__file__).parent / "nanovllm_kit.py"), "build", str(model)], check=True, timeout=300)
        return model

    def __init__(self, spec: dict[str, Any]) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import nanovllm_kit as kit

        torch = kit.install_standins(spec["port"])
        from nanovllm import LLM, SamplingParams
        from nanovllm.engine import model_runner

        self.params = SamplingParams
        self.integration: Any = None
        if spec["config"] in ("round", "elastic"):
            from gpumem.integrations import nanovllm as integration

            # A small headroom: under --capacity the round's default 512 MiB an engine stays
            # free, and on the H200 the bursts' grows took it all (0 shrinks, 0 blocks moved):
            # memory never moved between the engines. What an engine allocates outside its
            # arenas after the round is not the daemon's capacity (the device has plenty).
            integration.enable(spec["name"], expect=2, runtime_dir=spec["runtime_dir"], min_blocks=spec["min_blocks"],
                               follow=spec["config"] == "elastic", watermark_blocks=spec["watermark"], grow_step_blocks=spec["step"],
                               headroom_bytes=64 << 20)
            self.integration = integration
        else:
            blocks, allocate = spec["blocks"], model_runner.ModelRunner.allocate_kv_cache

            def sized(runner: Any) -> None:
                """nano-vllm sizes its cache as min(0.9 x free, ...): shown the free memory
                that makes it ``blocks`` blocks, it allocates those."""
                hf = runner.config.hf_config
                block_bytes = 2 * hf.num_hidden_layers * runner.block_size * hf.num_key_value_heads * hf.head_dim * runner.dtype.itemsize
                real = torch.cuda.mem_get_info
                torch.cuda.mem_get_info = lambda *a: (int((blocks + 0.5) * block_bytes / 0.9), real()[1])
                try:
                    allocate(runner)
                finally:
                    torch.cuda.mem_get_info = real

            model_runner.ModelRunner.allocate_kv_cache = sized
        self.llm = LLM(spec["model"], max_num_seqs=kit.MAX_NUM_SEQS, max_model_len=2048, max_num_batched_tokens=kit.MAX_BATCHED,
                       gpu_memory_utilization=1.0)
        scheduler = self.llm.scheduler
        self.preempted = 0
        preempt = scheduler.preempt

        def counted(seq: Any) -> None:
            self.preempted += 1
            preempt(seq)

        scheduler.preempt = counted
        self.rids: dict[int, int] = {}
        self.seen: set[int] = set()
        kit.generate(self.llm, kit.prompts(4), 4)  # warm: every configuration times steady state
        self.margins = kit.Margins(self.llm)  # every configuration pays the probe alike

    @property
    def blocks(self) -> int:
        return len(self.llm.scheduler.block_manager.blocks)

    @property
    def block_bytes(self) -> int:
        hf, runner = self.llm.model_runner.config.hf_config, self.llm.model_runner
        return int(2 * hf.num_hidden_layers * runner.block_size * hf.num_key_value_heads * hf.head_dim * runner.dtype.itemsize)

    def add(self, rid: int, prompt: list[int], max_tokens: int) -> None:
        self.llm.add_request(prompt, self.params(temperature=1.0, max_tokens=max_tokens, ignore_eos=True))
        self.rids[self.llm.scheduler.waiting[-1].seq_id] = rid

    def has_work(self) -> bool:
        return not self.llm.is_finished()

    def idle(self) -> None:
        if self.integration is not None:
            self.integration.idle(self.llm)

    def step(self) -> tuple[list[int], dict[int, list[int]], int]:
        finished, tokens = self.llm.step()
        self.margins.after_step()
        first = []
        for seq in [*self.llm.scheduler.running, *self.llm.scheduler.waiting]:
            if seq.num_completion_tokens >= 1 and seq.seq_id not in self.seen:
                self.seen.add(seq.seq_id)
                first.append(self.rids[seq.seq_id])
        done = {}
        for seq_id, ids in finished:
            if seq_id not in self.seen:
                self.seen.add(seq_id)
                first.append(self.rids[seq_id])
            done[self.rids[seq_id]] = ids
        return first, done, max(0, -tokens)

    def figures(self) -> dict[str, Any]:
        follower = self.integration.port(self.llm).follower if self.integration is not None else None
        follow = dataclasses.asdict(follower.figures) if follower is not None else {}
        margins = {str(rid): self.margins.by_seq.get(seq_id, []) for seq_id, rid in self.rids.items()}
        return {"blocks_end": self.blocks, "preempted": self.preempted, "follow": follow, "margins": margins}

    def close(self) -> None:
        pass  # nano-vllm exits itself at exit (atexit), which closes the session on gpumemd


# ---------------------------------------------------------------------- transformers


class Tf:
    """transformers' continuous batching (bench/transformers_kit.py's random-weight Qwen3):
    as shipped with a fixed block count (static, alone: ``num_blocks``), or on gpumemd
    (round, elastic: gpumem.integrations.transformers, the layout's ceiling
    ``CEILING`` rows). Float32: the four configurations batch the requests otherwise, and
    transformers gives no logit gaps to tell a near-tie (token_margins.TIE_GAP) from a
    block read back wrong, so tokens must not part at all. Its manager steps on a thread
    of its own: ``step`` takes what it streamed out since (a request's first token when
    this sees it), the decode steps are timed in that thread (transformers_kit.Steps),
    and its loop answers the daemon's shrinks while idle."""

    # Rows: 1.5x what a burst of 64 requests of 5 blocks asks, and above what the first
    # round gives under --capacity 24GiB (the bench resizes from that round). Each engine's
    # model arena pays for the ceiling (the attention mask is batch tokens by its pages, the
    # warm-up's graphs are captured at its largest read): the capacity must hold two.
    CEILING = 512
    BATCH_TOKENS = 2048

    @staticmethod
    def build(work: Path) -> None:
        return None  # each engine builds its random-weight model in its own process

    def __init__(self, spec: dict[str, Any]) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import torch
        import transformers_kit as kit

        self.kit, self.port = kit, None
        options: dict[str, Any] = {"max_batch_tokens": self.BATCH_TOKENS}
        if spec["config"] in ("round", "elastic"):
            from gpumem.integrations import transformers as integration

            # The small headroom of Nano's, for the same reason.
            integration.enable(spec["name"], max_blocks=self.CEILING, expect=2, runtime_dir=spec["runtime_dir"], min_blocks=spec["min_blocks"],
                               follow=spec["config"] == "elastic", watermark_blocks=spec["watermark"], grow_step_blocks=spec["step"],
                               headroom_bytes=64 << 20)
            self.port = integration.port
        else:
            options["num_blocks"] = spec["blocks"]
        self.manager = kit.build_model("qwen3", dtype=torch.float32).init_continuous_batching(continuous_batching_config=kit.config(**options))
        self.manager.warmup()
        self.manager.start()
        kit.generate(self.manager, kit.prompts(4), 4)  # warm: every configuration times steady state
        self.steps = kit.Steps(self.manager)
        self.stream = kit.Stream(self.manager)
        self.rids: dict[str, int] = {}

    @property
    def cache(self) -> Any:
        return self.manager.batch_processor.cache

    @property
    def blocks(self) -> int:
        return int(self.port().adapter.count - 2 if self.port is not None else self.cache.num_blocks)  # gpumemd: less its trash rows

    @property
    def block_bytes(self) -> int:
        return self.kit.block_bytes(self.cache)

    def add(self, rid: int, prompt: list[int], max_tokens: int) -> None:
        # The schedule's ids run to 32768 (nano-vllm's vocabulary): folded into the model's.
        self.rids[self.stream.add([t % self.kit.VOCAB for t in prompt], max_tokens, f"r{rid}")] = rid

    def has_work(self) -> bool:
        return len(self.stream.done) < len(self.rids)

    def idle(self) -> None:
        pass  # the manager's loop steps the port's gate when idle: it answers shrinks itself

    def step(self) -> tuple[list[int], dict[int, list[int]], int]:
        first, done = self.stream.poll(0.005)
        return [self.rids[r] for r in first], {self.rids[r]: self.stream.done[r] for r in done}, 0

    def figures(self) -> dict[str, Any]:
        """Its decode steps (timed in the manager's thread) stand for serve()'s."""
        follower = self.port().follower if self.port is not None else None
        decode = self.steps.decode
        return {"blocks_end": self.blocks, "preempted": self.steps.evicted, "follow": dataclasses.asdict(follower.figures) if follower else {},
                "decode_steps": decode, "decode_s": sum(t for _, t in decode), "decode_tokens": sum(b for b, _ in decode)}

    def close(self) -> None:
        self.manager.stop(block=True, timeout=30)
        os._exit(0)  # the manager's thread and the session on gpumemd end with the process (as bench/transformers_kit.py's engines)


ENGINES: dict[str, type[Nano] | type[Tf]] = {"nanovllm": Nano, "transformers": Tf}


# ---------------------------------------------------------------------- serving a schedule


def _wait_file(path: str) -> str:
    while not Path(path).exists():
        time.sleep(0.002)
    return Path(path).read_text()


def _write(path: str, data: dict[str, Any]) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)


def serve(spec: dict[str, Any]) -> int:
    engine: StandIn | Nano | Tf = StandIn(spec) if spec["backend"] == "host" else ENGINES[spec["engine"]](spec)  # the round runs in here
    _write(spec["ready"], {"blocks": engine.blocks, "block_bytes": engine.block_bytes})
    t0 = float(_wait_file(spec["go"]))
    pending = sorted(json.loads(Path(spec["schedule"]).read_text()), key=lambda r: r["at"])
    arrival = {r["id"]: t0 + r["at"] for r in pending}
    tails = {r["id"] for r in pending if r.get("tail")}
    decode_steps: list[tuple[int, float]] = []
    ttft: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    decode_s, decode_tokens, steps = 0.0, 0, 0
    while pending or engine.has_work():
        now = time.monotonic()
        while pending and arrival[pending[0]["id"]] <= now:
            r = pending.pop(0)
            engine.add(r["id"], r["prompt"], r["max_tokens"])
        if not engine.has_work():
            engine.idle()
            time.sleep(0.002)
            continue
        started = time.perf_counter()
        first, done, decoded = engine.step()
        took = time.perf_counter() - started
        steps += 1
        if decoded:
            decode_s += took
            decode_tokens += decoded
            decode_steps.append((decoded, took))
        now = time.monotonic()
        for rid in first:
            if rid not in tails:
                ttft[rid] = now - arrival[rid]
        tokens.update(done)
    _write(spec["out"], {
        "name": spec["name"], "config": spec["config"], "blocks_start": json.loads(Path(spec["ready"]).read_text())["blocks"],
        "ttft_s": {str(k): v for k, v in ttft.items()}, "tokens": {str(k): v for k, v in tokens.items()},
        "decode_s": decode_s, "decode_tokens": decode_tokens, "decode_steps": decode_steps, "steps": steps,
        **engine.figures(),  # after serve()'s: an engine that times its own steps (Tf) gives them
    })
    # Idle until told to stop: a neighbour may still burst and ask for blocks back.
    while not Path(spec["go"] + ".stop").exists():
        engine.idle()
        time.sleep(0.002)
    engine.close()
    return 0


def main(argv: list[str]) -> int:
    return int(c.exit_on_error(lambda: serve(json.loads(Path(argv[0]).read_text()))))
