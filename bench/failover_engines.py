"""The engines of bench/failover.py, one per process: a primary that serves and keeps its
KV cache for a successor, and a standby that waits and takes over. On the host backend
the stand-ins below; on CUDA the engine SPEC's ``engine`` names (``ROLES``): nano-vllm,
or transformers' continuous batching (bench/transformers_kit.py's model).

    python bench/failover_engines.py SPEC.json          # run by bench/failover.py

SPEC (JSON): role (primary | standby), backend, engine, runtime_dir, group, dir (where the files below
live), blocks (the KV pool's), and for the primary the prompts of both phases.

The primary maps its "weights" (an arena it fills and shares read-only with the
standby), declares a KV pool of two buffers (K and V, a block a row), makes a prefix
directory, retains both for ``group`` and writes the group's secret and the weights'
grant token (files only this uid reads). Once the standby is ready (it maps the
primary's weights, which live only while the primary does) it serves phase 1 (every
prompt), writes the token ids, then serves phase 2 (the same prompts again: its prefix
cache hits) and writes ``phase2`` after its first phase-2 step: bench/failover.py kills
it with -9 there. A primary that finishes phase 2 first waits to be killed: a clean exit
would close its session, and with it the group it retains.

The standby attaches the weights through the read-only grant, reserves the group's
windows (gpumem.standby) and builds its K and V arrays there. Its own model and graphs
arenas (EngineMemory, 16 MiB each) sleep as nano-vllm's standby's do (the graphs kept in
host memory, the model arena dropped) and its reservation is parked; then it writes
``ready`` with what it maps, and waits in ``adopt`` with the reservation. Once it holds
the group it wakes its arenas, and the arrays it built before read the adopted rows; it
seeds its prefix cache from the directory's trusted entries and serves phase 2, writing
the take-over's timeline (adopted, woke, seeded, first step, first token), the prompt
tokens that hit, and the token ids; the graphs arena's kept bytes are checked after
serving.

The engine is nano-vllm's scheduler and block manager in miniature, with its prefix
cache (chained block hashes; freed blocks keep theirs until reused), over real host
memory. Its "model" writes into each token's K and V slot a running hash of the
sequence up to that token (and a byte of the weights) and derives the next token from
every slot of the sequence read back through the block table: a block adopted wrong, or
trusted while the dead engine was rewriting it, changes the tokens. The primary
invalidates a block's directory entry before the block is written anew and publishes it
after the step that filled it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import _common as c

import numpy

import gpumem
from gpumem.engine import EngineMemory
from gpumem.prefix_directory import PrefixDirectory

BLOCK = 16  # tokens a block
SLOT = 8  # bytes of a token's slot in K and in V (an int64)
VOCAB = 32000
WEIGHTS_BYTES = 32 << 20
OWN_BYTES = 16 << 20  # the standby's model arena and graphs arena, each
MAX_NUM_SEQS = 64
DECODE_S = 0.004  # a decode step's compute, as a sleep: the figures measure memory, not this machine
ADOPT_WAIT_S = 600.0
WAIT_S = 600.0  # for a file the other side writes: bench/failover.py's run timeout ends the run first


def chain(prefix: int, tokens: list[int]) -> int:
    """A full block's content hash: its tokens and the hash of the blocks before it."""
    digest = hashlib.blake2b(prefix.to_bytes(8, "little") + numpy.asarray(tokens, dtype=numpy.int64).tobytes(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1  # below 2**63: it travels as a signed 64-bit too


class Seq:
    def __init__(self, rid: int, prompt: list[int], max_tokens: int) -> None:
        self.rid = rid
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.max_tokens = max_tokens
        self.table: list[int] = []
        self.cached = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def completion(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class Engine:
    """The block manager, the scheduler's bookkeeping and the model over K and V."""

    def __init__(self, k: numpy.ndarray, v: numpy.ndarray, weights: numpy.ndarray, blocks: int, directory: PrefixDirectory) -> None:
        self.k, self.v, self.weights = k, v, weights
        self.directory = directory
        self.free = collections.deque(range(blocks))
        self.refs = [0] * blocks
        self.block_hash = [-1] * blocks
        self.by_hash: dict[int, int] = {}

    def seed(self, trusted: dict[int, int]) -> None:
        """The dead engine's published blocks: cached, free until a prompt hits them."""
        for h, block in trusted.items():
            self.block_hash[block] = h
            self.by_hash[h] = block

    def _take(self) -> int:
        block = self.free.popleft()
        if self.block_hash[block] != -1:
            # Its rows are written anew from here on: the directory must not vouch for it.
            self.by_hash.pop(self.block_hash[block], None)
            self.block_hash[block] = -1
            self.directory.invalidate(block)
        self.refs[block] = 1
        return block

    def admit(self, seq: Seq) -> None:
        """Allocate the prompt's blocks, full blocks from the cache where they hit."""
        h = 0
        missed = False
        for i in range(0, len(seq.tokens), BLOCK):
            part = seq.tokens[i : i + BLOCK]
            full = len(part) == BLOCK and i + BLOCK < len(seq.tokens)  # the last token is always computed
            h = chain(h, part) if full else -1
            hit = self.by_hash.get(h, -1) if full and not missed else -1
            if hit >= 0:
                if self.refs[hit] == 0:
                    self.free.remove(hit)
                self.refs[hit] += 1
                seq.table.append(hit)
                seq.cached += BLOCK
                continue
            missed = True
            seq.table.append(self._take())
        self._write(seq, seq.cached, len(seq.tokens))

    def release(self, seq: Seq) -> None:
        for block in reversed(seq.table):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)

    def _slot_value(self, running: int, token: int) -> int:
        return (running * 1_000_003 + token + int(self.weights[token % WEIGHTS_BYTES])) % (1 << 61)

    def _write(self, seq: Seq, start: int, end: int) -> None:
        """Write the K and V slots of tokens [start, end); publish each block it filled."""
        running = int(self.k[seq.table[(start - 1) // BLOCK], (start - 1) % BLOCK]) if start else 0
        for pos in range(start, end):
            running = self._slot_value(running, seq.tokens[pos])
            block, slot = seq.table[pos // BLOCK], pos % BLOCK
            self.k[block, slot] = running
            self.v[block, slot] = running ^ 0x5A5A
        for pos in range(start, end):
            if pos % BLOCK == BLOCK - 1:
                self._publish(seq, pos // BLOCK)

    def _publish(self, seq: Seq, index: int) -> None:
        h = 0
        for i in range(index + 1):
            h = chain(h, seq.tokens[i * BLOCK : (i + 1) * BLOCK])
        block = seq.table[index]
        if self.block_hash[block] == -1 and h not in self.by_hash:
            self.block_hash[block] = h
            self.by_hash[h] = block
            self.directory.publish(block, h)

    def next_token(self, seq: Seq) -> int:
        """From every K and V slot of the sequence, read back through its block table."""
        n = len(seq.tokens)
        rows = numpy.asarray(seq.table[: (n + BLOCK - 1) // BLOCK])
        k = self.k[rows].reshape(-1)[:n]
        v = self.v[rows].reshape(-1)[:n]
        return int((int(k.sum() % (1 << 61)) * 31 + int((v ^ 0x5A5A).sum() % (1 << 61)) + n) % VOCAB)

    def decode(self, seq: Seq) -> None:
        token = self.next_token(seq)
        seq.tokens.append(token)
        pos = len(seq.tokens) - 1
        if pos % BLOCK == 0:
            seq.table.append(self._take())
        self._write(seq, pos, pos + 1)


def serve(engine: Engine, requests: list[dict[str, Any]], on_token: Any = None) -> dict[int, Seq]:
    """Every request to its end, up to MAX_NUM_SEQS at a time: each admitted (its
    prefill) and then decoded a token a step."""
    waiting = collections.deque(requests)
    running: list[Seq] = []
    done: dict[int, Seq] = {}
    while waiting or running:
        while waiting and len(running) < MAX_NUM_SEQS:
            r = waiting.popleft()
            seq = Seq(r["id"], r["prompt"], r["max_tokens"])
            engine.admit(seq)
            running.append(seq)
        time.sleep(DECODE_S)
        for seq in running:
            engine.decode(seq)
        if on_token is not None:
            on_token()
        for seq in [s for s in running if len(s.completion) >= s.max_tokens]:
            running.remove(seq)
            engine.release(seq)
            done[seq.rid] = seq
    return done


def _wait_file(path: Path, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} ({what}) did not appear within {WAIT_S:g}s: see the other engine's log")
        time.sleep(0.01)


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.chmod(tmp, 0o600)
    tmp.replace(path)


def _kv_arrays(view: Any, buffers: list[Any], blocks: int) -> tuple[numpy.ndarray, numpy.ndarray]:
    """K and V as blocks x BLOCK int64 arrays over the pool's two buffers, through ``view``."""
    k, v = (numpy.asarray(view(b.offset, blocks * b.row_bytes)).view(numpy.int64).reshape(blocks, BLOCK) for b in buffers)
    return k, v


def primary(spec: dict[str, Any], out: Path) -> int:
    session = gpumem.connect(0, name="fo-primary")
    weights = session.create_arena("fo-weights", WEIGHTS_BYTES)
    weights.commit(WEIGHTS_BYTES)
    weights.write(0, numpy.random.default_rng(7).integers(0, 256, WEIGHTS_BYTES, dtype=numpy.uint8).tobytes())
    token = weights.share("fo-standby", read_only=True)
    blocks = spec["blocks"]
    pool = session.declare_kv_pool("fo-kv", [gpumem.KvBuffer("k", BLOCK * SLOT), gpumem.KvBuffer("v", BLOCK * SLOT)], max_tokens=blocks)
    pool.grow(blocks)
    directory = session.create_prefix_directory("fo-prefix", blocks=blocks)
    group = session.retain_group(spec["group"])
    group.retain(pool, directory)
    _write_json(out / "secret.json", {"secret": group.secret, "weights_token": token})
    _wait_file(out / "standby-ready.json", "the standby ready")
    k, v = _kv_arrays(pool.arena.view, list(pool.buffers.values()), blocks)
    engine = Engine(k, v, numpy.asarray(weights.view()), blocks, directory)
    done = serve(engine, spec["requests"])
    _write_json(out / "phase1.json", {str(rid): s.completion for rid, s in done.items()})
    started = []

    def mark() -> None:
        if not started:
            started.append(True)
            _write_json(out / "phase2.json", {"at": time.monotonic()})

    serve(engine, spec["requests"], mark)
    _write_json(out / "primary-done.json", {})
    _wait_file(out / "close.json", "the end of the run")  # killed before this
    session.close()
    return 0


def standby(spec: dict[str, Any], out: Path) -> int:
    # A model arena and a graphs arena of its own, as nano-vllm's standby has (its
    # activations and graph inputs; its graph pool), put to sleep as that one's are.
    mem = EngineMemory("fo-standby", model_reserve=OWN_BYTES, graph_reserve=OWN_BYTES)
    session = mem.session
    _wait_file(out / "secret.json", "the primary's secret")
    given = json.loads((out / "secret.json").read_text())
    weights = session.attach_arena("fo-weights", token=given["weights_token"])
    reservation = session.reserve_retained(spec["group"], given["secret"])
    (kv_view,) = reservation.kv_pools.values()
    blocks = spec["blocks"]
    k, v = _kv_arrays(lambda offset, nbytes: reservation.view(kv_view.name, offset, nbytes), kv_view.buffers, blocks)
    captured = numpy.random.default_rng(11).integers(0, 256, OWN_BYTES, dtype=numpy.uint8).tobytes()
    for arena in (mem.model, mem.graphs):
        arena.commit(OWN_BYTES)
    mem.graphs.write(0, captured)  # what a capture leaves in its graph pool: kept across the sleep
    mem.sleep("weights", "graphs", drop=["weights"])
    reservation.park()  # as nano-vllm's asleep standby: nothing touches k and v until adopted
    _write_json(out / "standby-ready.json", {"pid": os.getpid(), "shared_weights_bytes": weights.committed, "asleep": mem.asleep})
    adopted = session.adopt(spec["group"], given["secret"], wait=ADOPT_WAIT_S, reservation=reservation)
    adopted_at = time.monotonic()
    mem.wake()
    woke_at = time.monotonic()
    directory = PrefixDirectory.open(next(iter(adopted.arenas.values())))
    scan = directory.scan(blocks)
    engine = Engine(k, v, numpy.asarray(weights.view()), blocks, directory)
    engine.seed(scan.blocks)
    seeded_at = time.monotonic()
    first: list[float] = []
    done = serve(engine, spec["requests"], lambda: first or first.append(time.monotonic()))
    if mem.graphs.read(0, OWN_BYTES) != captured:  # checked off the timed path: serving does not touch it
        raise RuntimeError("the standby's graphs arena woke without what it kept in host memory")
    _write_json(out / "standby.json", {
        "adopted_at": adopted_at,
        "woke_at": woke_at,
        "seeded_at": seeded_at,
        "first_step_at": seeded_at,  # serve() steps at once
        "first_token_at": first[0],
        "trusted": len(scan.blocks),
        "corrupt": scan.corrupt,
        "cached": sum(s.cached for s in done.values()),
        "prompt_tokens": sum(s.prompt_len for s in done.values()),
        "tokens": {str(rid): s.completion for rid, s in done.items()},
    })
    _wait_file(out / "close.json", "the end of the run")
    mem.close()
    return 0


# ---------------------------------------------------------------------- nano-vllm (CUDA)


def nano_primary(spec: dict[str, Any], out: Path) -> int:
    """nano-vllm retaining its KV cache and prefix directory, its weights granted
    read-only to the standby (gpumem.port.weights)."""
    import nanovllm_kit as kit

    kit.install_standins(spec["port"])
    from nanovllm import LLM, SamplingParams

    from gpumem.integrations import nanovllm as integration

    integration.enable("fo-primary", retain=spec["group"], weights_to="fo-standby")  # its round leaves the standby room (Settings.standby_room)
    llm = LLM(spec["model"], max_num_seqs=kit.MAX_NUM_SEQS, max_model_len=kit.MAX_MODEL_LEN, max_num_batched_tokens=kit.MAX_BATCHED)
    _write_json(out / "secret.json", {"secret": integration.retain_secret(llm)})
    _wait_file(out / "standby-ready.json", "the standby ready")
    batch = [r["prompt"] for r in spec["requests"]]
    kit.generate(llm, batch, spec["requests"][0]["max_tokens"])  # every prompt prefilled whole, its full blocks published
    # The reference is the same prompts again, their full blocks from the prefix cache:
    # the standby computes exactly that. Against the whole prefill, bf16 near-ties may
    # part (other kernels), which says nothing about the adopted bytes.
    margins = kit.Margins(llm)  # per token, the lead of the best logit: where the standby parts, was it a near-tie?
    tokens = kit.generate(llm, batch, spec["requests"][0]["max_tokens"]).tokens
    margins.after_step()
    by_seq = [margins.by_seq[k] for k in sorted(margins.by_seq)]  # the pass's sequences, in the order added
    _write_json(out / "phase1-margins.json", {str(r["id"]): m for r, m in zip(spec["requests"], by_seq)})
    _write_json(out / "phase1.json", {str(r["id"]): t for r, t in zip(spec["requests"], tokens)})
    params = SamplingParams(temperature=1.0, max_tokens=spec["requests"][0]["max_tokens"], ignore_eos=True)
    for prompt in batch:
        llm.add_request(prompt, params)
    llm.step()
    _write_json(out / "phase2.json", {"at": time.monotonic()})
    while not llm.is_finished():
        llm.step()
    _write_json(out / "primary-done.json", {})
    _wait_file(out / "close.json", "the end of the run")  # killed before this
    return 0


def nano_standby(spec: dict[str, Any], out: Path) -> int:
    """nano-vllm on the primary's weights, which rehearses serving and puts its own
    memory to sleep once built (gpumem.port.takeover), then waits in
    ``take_over``; ``standby.json`` has the take-over's timeline."""
    import nanovllm_kit as kit
    import nanovllm_probes as probes

    kit.install_standins(spec["port"])
    from nanovllm import LLM, SamplingParams

    from gpumem.integrations import nanovllm as integration

    _wait_file(out / "secret.json", "the primary's secret")
    secret = json.loads((out / "secret.json").read_text())["secret"]
    integration.enable("fo-standby", standby=(spec["group"], secret), share_weights=True)
    with kit.probes_discarded():  # its rehearsal warms the probe that Margins times below
        llm = LLM(spec["model"], max_num_seqs=kit.MAX_NUM_SEQS, max_model_len=kit.MAX_MODEL_LEN, max_num_batched_tokens=kit.MAX_BATCHED)
    ready = {"pid": os.getpid(), "shared_weights_bytes": integration.shared_weights_bytes(llm), "asleep": llm.model_runner._gpumem.asleep}
    probes.diagnose(ready, "model_arena_live", lambda: probes.model_arena_live(llm.model_runner))
    _write_json(out / "standby-ready.json", ready)
    took = integration.take_over(llm, wait=ADOPT_WAIT_S)
    manager = llm.scheduler.block_manager
    allocate, cached = manager.allocate, []

    def counted(seq: Any) -> None:
        allocate(seq)
        cached.append(seq.num_cached_tokens)

    manager.allocate = counted
    params = SamplingParams(temperature=1.0, max_tokens=spec["requests"][0]["max_tokens"], ignore_eos=True)
    for r in spec["requests"]:
        llm.add_request(r["prompt"], params)
    first: list[float] = []
    outputs: dict[int, list[int]] = {}
    margins = kit.Margins(llm)
    first_step_at = time.monotonic()
    while not llm.is_finished():
        finished, _ = llm.step()
        first = first or [time.monotonic()]
        margins.after_step()
        outputs.update(dict(finished))
    order = sorted(outputs)  # seq ids in the order the requests were added
    _write_json(out / "standby.json", {
        "adopted_at": took.adopted_at, "woke_at": took.woke_at, "seeded_at": took.seeded_at, "first_step_at": first_step_at,
        "first_token_at": first[0], "trusted": took.seeded, "corrupt": took.corrupt, "cached": sum(cached),
        "prompt_tokens": sum(len(r["prompt"]) for r in spec["requests"]),
        "tokens": {str(r["id"]): outputs[seq_id] for r, seq_id in zip(spec["requests"], order)},
        "margins": {str(r["id"]): margins.by_seq.get(seq_id, []) for r, seq_id in zip(spec["requests"], order)},
    })
    _wait_file(out / "close.json", "the end of the run")
    return 0


# ---------------------------------------------------------------------- transformers (CUDA)

# bench/transformers_kit.py's Qwen3 as tests/integration/test_transformers_gpu.py's failover
# runs it: float32 (the standby's prefill from seeded blocks and the primary's from its own
# prefix cache part nowhere near a tie; transformers gives no logit gaps) and a small
# layout (the standby's batch tensors, batch tokens by the primary's pages, fit the room the
# primary's round leaves it).
TF_BATCH_TOKENS, TF_CEILING = 512, 2048


def _tf_manager(kit: Any) -> Any:
    import torch

    model = kit.build_model("qwen3", dtype=torch.float32)
    manager = model.init_continuous_batching(continuous_batching_config=kit.config(max_batch_tokens=TF_BATCH_TOKENS))
    manager.warmup()  # a standby settles in here: rehearsed, asleep
    return manager


def tf_primary(spec: dict[str, Any], out: Path) -> int:
    """transformers' manager retaining its KV cache and prefix directory (its weights
    are its own: transformers' integration shares none)."""
    import transformers_kit as kit

    from gpumem.integrations import transformers as integration

    integration.enable("fo-primary", retain=spec["group"], max_blocks=TF_CEILING)
    manager = _tf_manager(kit)
    manager.start()
    _write_json(out / "secret.json", {"secret": integration.port().retain_secret()})
    _wait_file(out / "standby-ready.json", "the standby ready")
    batch, tokens = [r["prompt"] for r in spec["requests"]], spec["requests"][0]["max_tokens"]
    kit.generate(manager, batch, tokens)  # every prompt prefilled whole, its full blocks published
    # The reference: the same prompts again, their full blocks from the prefix cache, as the standby's are.
    _write_json(out / "phase1.json", {str(r["id"]): t for r, t in zip(spec["requests"], kit.generate(manager, batch, tokens)[0])})
    stream = kit.Stream(manager)
    for prompt in batch:
        stream.add(prompt, tokens)
    while not stream.poll(1.0)[0]:  # its first phase-2 token: a step ran
        pass
    _write_json(out / "phase2.json", {"at": time.monotonic()})
    while len(stream.done) < len(batch):
        stream.poll(1.0)
    _write_json(out / "primary-done.json", {})
    _wait_file(out / "close.json", "the end of the run")  # killed before this
    manager.stop(block=True, timeout=30)
    os._exit(0)  # the manager's thread and the session on gpumemd end with the process (as tf_standby)


def tf_standby(spec: dict[str, Any], out: Path) -> int:
    """transformers' manager built as the standby (its layout on the primary's windows,
    rehearsed and asleep at the end of ``warmup()``), then in ``take_over``; its
    manager starts once it took over; ``standby.json`` has the take-over's timeline."""
    import transformers_kit as kit

    from gpumem.integrations import transformers as integration

    _wait_file(out / "secret.json", "the primary's secret")
    integration.enable("fo-standby", standby=(spec["group"], json.loads((out / "secret.json").read_text())["secret"]))
    manager = _tf_manager(kit)
    port = integration.port()
    _write_json(out / "standby-ready.json", {"pid": os.getpid(), "shared_weights_bytes": 0, "asleep": port.mem.asleep})
    took = port.take_over(wait=ADOPT_WAIT_S)
    manager.start()
    cache = manager.batch_processor.cache
    hit_before = cache._total_prefix_length  # transformers' count of prompt tokens its prefix cache gave
    stream = kit.Stream(manager)
    first_step_at = time.monotonic()
    ids = [stream.add(r["prompt"], r["max_tokens"], f"fo-{r['id']}") for r in spec["requests"]]
    while len(stream.done) < len(ids):
        stream.poll(1.0)
    _write_json(out / "standby.json", {
        "adopted_at": took.adopted_at, "woke_at": took.woke_at, "seeded_at": took.seeded_at, "first_step_at": first_step_at,
        "first_token_at": min(stream.first_at.values()), "trusted": took.seeded, "corrupt": took.corrupt,
        "cached": cache._total_prefix_length - hit_before, "prompt_tokens": sum(len(r["prompt"]) for r in spec["requests"]),
        "tokens": {str(r["id"]): stream.done[i] for r, i in zip(spec["requests"], ids)},
    })
    _wait_file(out / "close.json", "the end of the run")
    manager.stop(block=True, timeout=30)
    os._exit(0)  # the manager's thread and the session on gpumemd end with the process (as bench/transformers_kit.py's engines)


# Each engine's two roles on CUDA (bench/failover.py --engine); the host runs the stand-ins above.
ROLES = {"nanovllm": (nano_primary, nano_standby), "transformers": (tf_primary, tf_standby)}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    out = Path(spec["dir"])
    roles = ROLES[spec["engine"]] if spec["backend"] == "cuda" else (primary, standby)
    role = roles[0] if spec["role"] == "primary" else roles[1]
    return int(c.exit_on_error(lambda: role(spec, out)))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
