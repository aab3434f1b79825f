#!/usr/bin/env python3
"""nano-vllm without a network, for bench/engine.py and tests/integration/test_engine_gpu.py.

    python bench/nanovllm_kit.py build DIR                 # a random-weight Qwen3 and a tokenizer
    python bench/nanovllm_kit.py engine --model DIR --mode gpumemd --name a --out a.json ...

``build`` writes a Hugging Face model directory offline: a small Qwen3 config, random
weights (safetensors, seeded) and a word-level tokenizer trained on nothing (made with the
``tokenizers`` library, saved as a ``PreTrainedTokenizerFast``).

``engine`` runs one nano-vllm engine in this process, as shipped (``--mode shipped``) or
on gpumemd through ``gpumem.integrations.nanovllm`` (``--mode gpumemd``), generates the
fixed prompts greedily and writes its figures as JSON. Before nano-vllm is imported it
gets, in this process only, what the test machine lacks or what a comparison needs:
a torch stand-in for flash-attn's two functions (scaled-dot-product attention over the
paged cache: correct, not fast), a greedy sampler (the fork refuses temperature 0), RoPE
settings it accepts (transformers 5 reports the default RoPE as a dict; nano-vllm asserts
None), a distributed port of its own (two engines starting together race for one),
torch.compile turned off, cuBLAS's reproducible workspace setting and torch's cuDNN
attention off (not deterministic; the same for both modes).

After the engine is built: a scan of its KV cache, the attention backend torch picks,
a warm-up, one probed pass (the tokens compared across runs, with the logit gaps and
checksums that say where and why runs part), ``--passes`` timed passes (with the median
time per step of ``run``, ``replay`` and ``sampler``), then what the flags ask for: an
eager A/B of the stand-in's attention, the sampler's borrowing figures, a second pass on
a signal (``--again-after``), timed passes on request (``--duel``), serving forever. The
probes of the engine and its arenas are bench/nanovllm_probes.py's; the two checks of the
stand-ins themselves (``sdpa_choice``, ``attention_ab``) are here, beside the stand-ins.

Imported as well, by bench/burst_engines.py, bench/failover_engines.py and
tests/integration/test_standby_gpu.py: the model's sizes, ``install_standins``,
``generate`` and ``Margins`` (each generated token's logit gap, which the greedy sampler
records). Judging two runs' tokens by those gaps needs no engine: bench/token_margins.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import statistics
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nanovllm_probes import StepParts, borrow_overlaps, device_use, diagnose, kv_scan, sampler_borrowing
from token_margins import differing

LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4, 2048, 8192, 16, 4, 128, 32768
MAX_NUM_SEQS, MAX_MODEL_LEN, MAX_BATCHED = 64, 1024, 8192
PROMPT_SEED = 1234
# Switches of the stand-ins, set by this process: "unmasked" makes the decode attention read
# the slots past each sequence's length as they are (the first stand-in did; eager A/B only).
STANDIN: dict[str, bool] = {"unmasked": False}
_SAMPLER: list[Any] = [None]  # the engine's sampler class, once install_standins ran


# ---------------------------------------------------------------------- the model directory


def build(path: Path, seed: int = 0) -> None:
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_bias": False,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 1,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> Any:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> Any:
        return torch.ones(n, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rnd(VOCAB, HIDDEN), "model.norm.weight": ones(HIDDEN), "lm_head.weight": rnd(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        tensors.update({
            pre + "self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, HIDDEN),
            pre + "self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, HIDDEN),
            pre + "self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, HIDDEN),
            pre + "self_attn.o_proj.weight": rnd(HIDDEN, HEADS * HEAD_DIM),
            pre + "self_attn.q_norm.weight": ones(HEAD_DIM),
            pre + "self_attn.k_norm.weight": ones(HEAD_DIM),
            pre + "mlp.gate_proj.weight": rnd(INTERMEDIATE, HIDDEN),
            pre + "mlp.up_proj.weight": rnd(INTERMEDIATE, HIDDEN),
            pre + "mlp.down_proj.weight": rnd(HIDDEN, INTERMEDIATE),
            pre + "input_layernorm.weight": ones(HIDDEN),
            pre + "post_attention_layernorm.weight": ones(HIDDEN),
        })
    save_file(tensors, str(path / "model.safetensors"))
    vocab = {"<unk>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>").save_pretrained(str(path))


def prompts(n: int) -> list[list[int]]:
    """Fixed prompts, shorter than a KV block (256 tokens): no prefix-cache hits."""
    rng = random.Random(PROMPT_SEED)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(64, 200))] for _ in range(n)]


# ---------------------------------------------------------------------- stand-ins


def _flash_attn(torch: Any) -> types.ModuleType:
    F = torch.nn.functional

    def flash_attn_varlen_func(
        q: Any, k: Any, v: Any, max_seqlen_q: int, cu_seqlens_q: Any, max_seqlen_k: int, cu_seqlens_k: Any,
        softmax_scale: float, causal: bool = True, block_table: Any = None,
    ) -> Any:
        out = torch.empty_like(q)
        starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for i in range(len(starts_q) - 1):
            q_i = q[starts_q[i]:starts_q[i + 1]]
            n_k = starts_k[i + 1] - starts_k[i]
            if block_table is None:
                k_i, v_i = k[starts_k[i]:starts_k[i + 1]], v[starts_k[i]:starts_k[i + 1]]
            else:
                blocks = block_table[i].clamp(min=0)
                k_i, v_i = k[blocks].flatten(0, 1)[:n_k], v[blocks].flatten(0, 1)[:n_k]
            n_q = q_i.shape[0]
            # flash-attn's causal mask is aligned bottom-right when keys outnumber queries
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q) if causal else None
            o = F.scaled_dot_product_attention(
                q_i.transpose(0, 1)[None], k_i.transpose(0, 1)[None], v_i.transpose(0, 1)[None],
                attn_mask=mask, scale=softmax_scale, enable_gqa=True,
            )
            out[starts_q[i]:starts_q[i + 1]] = o[0].transpose(0, 1)
        return out

    def flash_attn_with_kvcache(
        q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, block_table: Any, softmax_scale: float, causal: bool = True
    ) -> Any:
        # No host sync and fixed shapes: this runs inside CUDA-graph capture. Every slot of
        # every block-table entry is gathered, also past the sequence's length: a slot not
        # written yet, a block another sequence owns (an unused entry, -1, reads block 0).
        # flash-attn reads none of them. Masking their scores is not enough: their bytes
        # are whatever the memory held (torch.empty, or a daemon's recycled chunk), and
        # were a NaN or Inf bit pattern among them, 0 * NaN is NaN, as is an Inf score
        # plus the mask's -Inf: the row's output would turn NaN. So they are zeroed
        # before they meet the arithmetic. (On the H200 the KV caches held none: a
        # scan found no non-finite value; this is not what made runs differ.)
        batch, width = block_table.shape
        blocks = block_table.clamp(min=0)
        k = k_cache[blocks].flatten(1, 2)  # (batch, width * block, kv heads, dim)
        v = v_cache[blocks].flatten(1, 2)
        positions = torch.arange(k.shape[1], device=q.device)
        valid = positions[None, :] < cache_seqlens[:, None]
        if not STANDIN["unmasked"]:  # the first stand-in's way, for bench/engine.py's A/B only
            gone = ~valid[:, :, None, None]
            k, v = k.masked_fill(gone, 0), v.masked_fill(gone, 0)
        mask = valid | (positions[None, :] == 0)  # padded rows (length 0) stay finite
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :],
            scale=softmax_scale, enable_gqa=True,
        )
        return o.transpose(1, 2)

    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = flash_attn_varlen_func  # type: ignore[attr-defined]
    module.flash_attn_with_kvcache = flash_attn_with_kvcache  # type: ignore[attr-defined]
    return module


def greedy_sampler(torch: Any) -> type:
    class GreedySampler(torch.nn.Module):  # type: ignore[misc, name-defined]
        """Greedy, with a sampler's temporaries: float logits and probabilities. While
        ``probe`` is a list, each call appends what a comparison of runs needs: per row,
        the gap between the best and the second-best logit (0: a tie, decided by index);
        the rows with a non-finite logit; where the logits lay; and the sum of their bit
        patterns (equal sums: logits alike to the bit, as far as a checksum tells)."""

        probe: list[tuple[list[float], int, int, int]] | None = None

        def forward(self, logits: Any, temperatures: Any, *args: Any, **kwargs: Any) -> Any:
            probe = type(self).probe
            if probe is not None:  # small temporaries: this may run borrowed
                top = logits.topk(2, dim=-1).values.float()
                bad = int((~torch.isfinite(logits)).any(dim=-1).sum())
                bits = int(logits.contiguous().view(torch.int16).sum(dtype=torch.int64))
                probe.append(((top[:, 0] - top[:, 1]).tolist(), bad, logits.data_ptr(), bits))
                del top
            probs = torch.softmax(logits.float(), dim=-1)
            return probs.argmax(dim=-1)

    return GreedySampler


def install_standins(port: int) -> Any:
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # read by torch at import: this process only
    # cuBLAS picks reproducible algorithms only with a fixed workspace configuration; the
    # runs compare token ids, and random bf16 weights leave near-ties in the logits.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    # The stand-in's attention is torch's scaled-dot-product attention, and torch 2.11 on
    # an H200 (sm90, cuDNN > 9.15) tries cuDNN's first: the one backend torch itself calls
    # not deterministic (it refuses it under use_deterministic_algorithms). With it, the
    # decode steps' logits differed from run to run, in one process and across processes,
    # while the prefill's were alike to the bit; greedy near-ties (random bf16 weights
    # leave many) turned that into different tokens. Without it, torch picks its
    # memory-efficient kernel for these masked, grouped-query shapes.
    torch.backends.cuda.enable_cudnn_sdp(False)
    sys.modules["flash_attn"] = _flash_attn(torch)
    from nanovllm.engine import model_runner
    from nanovllm.models import qwen3

    model_runner.Sampler = _SAMPLER[0] = greedy_sampler(torch)
    model_runner.find_available_port = lambda *args, **kwargs: port
    get_rope = qwen3.get_rope

    def default_rope(head_size: int, rotary_dim: int, max_position: int, base: float, rope_scaling: Any = None) -> Any:
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", "default") == "default":
            rope_scaling = None
        return get_rope(head_size, rotary_dim, max_position, base, rope_scaling)

    qwen3.get_rope = default_rope
    return torch


def attention_ab(llm: Any, runner: Any, batch: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """The stand-in's decode attention as fixed against the first one (which let the
    slots past each sequence's length into the arithmetic), both eager (a graph has one
    of them captured): same shapes, so what differs is that alone."""
    runner.enforce_eager = True
    try:
        masked = generate(llm, batch, max_tokens, probe=True)
        STANDIN["unmasked"] = True
        unmasked = generate(llm, batch, max_tokens, probe=True)
    finally:
        STANDIN["unmasked"] = False
        runner.enforce_eager = False
    return {"masked_nonfinite_rows": masked.nonfinite_rows, "unmasked_nonfinite_rows": unmasked.nonfinite_rows,
            "unmasked_differ": differing(unmasked.tokens, masked.tokens), "tokens": masked.tokens}


def sdpa_choice(torch: Any) -> dict[str, dict[str, str]]:
    """The backend torch picks for the stand-in's attention shapes (decode: one query per
    sequence against a full block-table row, masked; prefill: one sequence, causal mask),
    as set up here and as torch would by default (cuDNN's allowed)."""
    from torch.nn.attention import SDPBackend

    def pick() -> dict[str, str]:
        bf16, width = torch.bfloat16, -(-MAX_MODEL_LEN // 256) * 256
        q = torch.zeros(MAX_NUM_SEQS, HEADS, 1, HEAD_DIM, device="cuda", dtype=bf16)
        k = torch.zeros(MAX_NUM_SEQS, KV_HEADS, width, HEAD_DIM, device="cuda", dtype=bf16)
        mask = torch.ones(MAX_NUM_SEQS, 1, 1, width, device="cuda", dtype=torch.bool)
        pq = torch.zeros(1, HEADS, 128, HEAD_DIM, device="cuda", dtype=bf16)
        pk = torch.zeros(1, KV_HEADS, 128, HEAD_DIM, device="cuda", dtype=bf16)
        causal = torch.ones(128, 128, device="cuda", dtype=torch.bool).tril()
        return {
            "decode": SDPBackend(torch._fused_sdp_choice(q, k, k, mask, 0.0, False, scale=None, enable_gqa=True)).name,
            "prefill": SDPBackend(torch._fused_sdp_choice(pq, pk, pk, causal, 0.0, False, scale=None, enable_gqa=True)).name,
        }

    here = pick()
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        default = pick()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
    return {"here": here, "torch_default": default}


# ---------------------------------------------------------------------- one engine


@dataclasses.dataclass
class Pass:
    """One generation of a batch: completions in order, decode time and tokens, and with
    ``probe``: the top-1/top-2 logit gap of every generated token (as ``tokens``), the
    logit rows that held a non-finite value, the logits' addresses and, step by step, a
    checksum of their bits."""

    tokens: list[list[int]]
    decode_s: float
    decode_tokens: int
    step_s: list[float]
    margins: list[list[float]] | None = None
    nonfinite_rows: int = 0
    logits_at: list[int] = dataclasses.field(default_factory=list)
    checksums: list[int] = dataclasses.field(default_factory=list)

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


def generate(llm: Any, batch: list[list[int]], max_tokens: int, probe: bool = False) -> Pass:
    """Greedy completions of ``batch`` (in order) and the time spent in decode steps."""
    from nanovllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    for prompt in batch:
        llm.add_request(prompt, params)
    outputs: dict[int, list[int]] = {}
    margins: dict[int, list[float]] = {}
    result = Pass([], 0.0, 0, [])
    scheduled: list[list[Any]] = []
    calls: list[tuple[list[float], int, int, int]] = []
    if probe:
        schedule = llm.scheduler.schedule

        def recording() -> Any:
            seqs, is_prefill = schedule()
            scheduled.append(seqs)
            return seqs, is_prefill

        llm.scheduler.schedule = recording  # this instance only, until the pass ends
        _SAMPLER[0].probe = calls
    try:
        while not llm.is_finished():
            started = time.perf_counter()
            finished, tokens = llm.step()
            took = time.perf_counter() - started
            if tokens < 0:
                result.decode_s += took
                result.decode_tokens -= tokens
                result.step_s.append(took)
            if probe:
                row_margins, bad, at, bits = calls.pop()
                result.checksums.append(bits)
                for seq, margin in zip(scheduled.pop(), row_margins):
                    margins.setdefault(seq.seq_id, []).append(margin)
                result.nonfinite_rows += bad
                result.logits_at.append(at)
            for seq_id, ids in finished:
                outputs[seq_id] = ids
    finally:
        if probe:
            del llm.scheduler.schedule
            _SAMPLER[0].probe = None
    result.tokens = [outputs[k] for k in sorted(outputs)]
    if probe:
        result.margins = [margins[k] for k in sorted(outputs)]
    return result


class Margins:
    """From now on, at every step of ``llm``: per sequence id, the gap between the best
    and the second-best logit of each token it generates (the greedy sampler's probe;
    ``after_step`` pairs the step's rows with the sequences its schedule gave). Where two
    runs of one request part, the gap there says whether a near-tie decided it: bf16
    logits of a batch of another size differ in their last bits."""

    def __init__(self, llm: Any) -> None:
        self.by_seq: dict[int, list[float]] = {}
        self._scheduled: list[list[Any]] = []
        self._calls: list[tuple[list[float], int, int, int]] = []
        schedule = llm.scheduler.schedule

        def recording() -> Any:
            seqs, is_prefill = schedule()
            self._scheduled.append(seqs)
            return seqs, is_prefill

        llm.scheduler.schedule = recording  # this instance only
        _SAMPLER[0].probe = self._calls

    def after_step(self) -> None:
        for (gaps, *_), seqs in zip(self._calls, self._scheduled, strict=True):
            for seq, gap in zip(seqs, gaps):
                self.by_seq.setdefault(seq.seq_id, []).append(round(gap, 5))
        self._calls.clear()
        self._scheduled.clear()


@contextlib.contextmanager
def probes_discarded() -> Iterator[None]:
    """Meanwhile the greedy sampler probes (``Margins``' figures) into a list thrown away:
    a standby built inside rehearses serving with the probe on (gpumem's
    gpumem.port.takeover), so the probe of its first step after the take-over, which the
    bench times, launches no kernel for the first time."""
    _SAMPLER[0].probe = []
    try:
        yield
    finally:
        _SAMPLER[0].probe = None


def engine(args: argparse.Namespace) -> int:
    torch = install_standins(args.port)
    from nanovllm import LLM

    if args.mode == "gpumemd":
        from gpumem.integrations import nanovllm as integration

        headroom = {} if args.headroom is None else {"headroom_bytes": args.headroom << 20}
        integration.enable(args.name, expect=args.expect, runtime_dir=args.runtime_dir, **headroom)
    _wait_file(args.start_after)  # imported: start when told
    out: dict[str, Any] = {"mode": args.mode, "name": args.name, "pid": os.getpid()}
    started = time.perf_counter()
    llm = LLM(args.model, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_BATCHED,
              gpu_memory_utilization=args.util)
    out["startup_s"] = time.perf_counter() - started
    runner = llm.model_runner
    after_round = device_use(torch, runner)
    out["blocks"] = runner.config.num_kvcache_blocks
    out["block_bytes"] = 2 * LAYERS * runner.block_size * KV_HEADS * HEAD_DIM * 2
    diagnose(out, "kv_scan", lambda: kv_scan(torch, runner, out["blocks"]))
    diagnose(out, "sdpa", lambda: sdpa_choice(torch))
    parts = StepParts()
    parts.install(runner)
    batch = prompts(args.prompts)
    generate(llm, batch[:8], 4)  # warm: both modes time steady state
    first = generate(llm, batch, args.tokens, probe=True)  # the tokens compared across runs
    parts.clear()
    timed = [generate(llm, batch, args.tokens) for _ in range(args.passes)]
    out.update(tokens=first.tokens, margins=first.margins, checksums=first.checksums, nonfinite_logit_rows=first.nonfinite_rows,
               prefill_steps=len(first.checksums) - len(first.step_s),
               repeat_differ=max((differing(t.tokens, first.tokens) for t in timed), default=0),
               decode_passes_tok_s=[t.decode_tok_s for t in timed], decode_tok_s=_median([t.decode_tok_s for t in timed]),
               decode_step_ms=1000 * _median([s for t in timed for s in t.step_s]), step_parts_ms=parts.medians_ms())
    if args.mode == "gpumemd":
        import msgspec

        # What the engine took from the device after its round, past what its arenas
        # held then: what the round's headroom must leave free (alone in the round, no
        # one else moves the device's free memory meanwhile).
        out["after_round"] = {key: now - after_round[key] for key, now in device_use(torch, runner).items()}
        mem = runner._gpumem
        out["model_usage"] = vars(mem.model.usage())
        out["graphs_usage"] = vars(mem.graphs.usage())
        out["kv_budget"] = msgspec.structs.asdict(mem.kv.pool.budget)
        diagnose(out, "borrow_overlaps", lambda: borrow_overlaps(runner, mem, first.logits_at))
    if args.ab_attention:
        diagnose(out, "attention_ab", lambda: attention_ab(llm, runner, batch, args.tokens))
    if args.mode == "gpumemd" and args.borrow_figures:
        out["sampler"] = sampler_borrowing(torch, runner._gpumem, greedy_sampler(torch)(), MAX_NUM_SEQS, VOCAB)
    _write(args.out, out)
    if args.again_after:  # keep serving: once the file appears, generate the same batch again
        while not Path(args.again_after).exists():
            generate(llm, batch[:8], 4)
        again = generate(llm, batch, args.tokens)
        _write(args.out + ".again", {"same_tokens": again.tokens == first.tokens, "sequences": len(again.tokens),
                                     "differ": differing(again.tokens, first.tokens)})
    if args.sleep_cycle:
        sleep_cycle(torch, llm, batch, args.tokens, first.tokens, Path(args.sleep_cycle))
    if args.duel:
        duel(llm, batch, args.tokens, first.tokens, Path(args.duel), args.name, parts)
    if args.serve_forever:
        while True:
            generate(llm, batch, args.tokens)
    return 0


def sleep_cycle(torch: Any, llm: Any, batch: list[list[int]], max_tokens: int, tokens: list[list[int]], folder: Path) -> None:
    """The colocation step: sleep (weights and graphs kept in host memory, the KV cache
    dropped), say what was freed (``asleep.json``), wait for ``wake`` (another process
    uses the memory meanwhile), wake, then time the first token of one prompt and
    compare the batch's tokens with ``tokens`` (``woke.json``)."""
    from gpumem.integrations import nanovllm as integration

    runner = llm.model_runner
    before = device_use(torch, runner)
    free_before = torch.cuda.mem_get_info()[0]
    started = time.perf_counter()
    integration.sleep(llm)
    slept_s = time.perf_counter() - started
    after = device_use(torch, runner)
    _write(str(folder / "asleep.json"), {"sleep_s": slept_s, "freed_bytes": before["arena_bytes"] - after["arena_bytes"],
                                         "device_freed_bytes": torch.cuda.mem_get_info()[0] - free_before})
    _wait_file(str(folder / "wake"))
    started = time.perf_counter()
    integration.wake(llm)
    wake_s = time.perf_counter() - started
    started = time.perf_counter()
    generate(llm, batch[:1], 1)
    ttft_s = time.perf_counter() - started
    again = generate(llm, batch, max_tokens)
    _write(str(folder / "woke.json"), {"wake_s": wake_s, "ttft_s": ttft_s, "same_tokens": again.tokens == tokens,
                                       "differ": differing(again.tokens, tokens), "blocks": runner.config.num_kvcache_blocks})


def duel(llm: Any, batch: list[list[int]], max_tokens: int, tokens: list[list[int]], folder: Path, name: str,
         parts: StepParts) -> None:
    """Timed passes on request, for decode figures taken in turns with another engine:
    pass ``i`` runs once ``folder/NAME.i.go`` exists and writes ``folder/NAME.i.json``
    (decode tokens/s over the pass and from its median step, which a slow step or two
    does not move); ``folder/stop`` ends the loop."""
    i = 0
    while True:
        go = folder / f"{name}.{i}.go"
        while not go.exists():
            if (folder / "stop").exists():
                return
            time.sleep(0.005)
        parts.clear()
        run = generate(llm, batch, max_tokens)
        step = _median(run.step_s)
        _write(str(folder / f"{name}.{i}.json"), {
            "decode_tok_s": run.decode_tok_s, "decode_step_ms": 1000 * step, "step_tok_s": len(batch) / step if step else 0.0,
            "step_parts_ms": parts.medians_ms(), "differ": differing(run.tokens, tokens)})
        i += 1


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _wait_file(path: str) -> None:
    while path and not Path(path).exists():
        time.sleep(0.02)


def _write(path: str, data: dict[str, Any]) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the model directory")
    b.add_argument("path", type=Path)
    e = sub.add_parser("engine", help="run one engine and write its figures")
    e.add_argument("--model", required=True)
    e.add_argument("--mode", choices=["shipped", "gpumemd"], required=True)
    e.add_argument("--name", default="engine")
    e.add_argument("--out", required=True)
    e.add_argument("--port", type=int, default=29500)
    e.add_argument("--util", type=float, default=0.9, help="gpu_memory_utilization (shipped; gpumemd ignores it)")
    e.add_argument("--expect", type=int, default=1, help="engines the KV round gathers (gpumemd)")
    e.add_argument("--runtime-dir", default=None)
    e.add_argument("--headroom", type=int, help="MiB the round leaves free (gpumemd; default: the integration's)")
    e.add_argument("--prompts", type=int, default=64)
    e.add_argument("--tokens", type=int, default=64)
    e.add_argument("--borrow-figures", action="store_true")
    e.add_argument("--again-after", default="", help="once this file exists, generate again and compare")
    e.add_argument("--start-after", default="", help="import, then build the engine once this file exists")
    e.add_argument("--passes", type=int, default=2, help="timed passes after the compared one (decode figures)")
    e.add_argument("--ab-attention", action="store_true", help="eager A/B of the stand-in's decode attention")
    e.add_argument("--duel", default="", help="then run timed passes on request (files in this folder)")
    e.add_argument("--sleep-cycle", default="", help="then sleep, wait for FOLDER/wake, wake and generate again (files in FOLDER)")
    e.add_argument("--serve-forever", action="store_true")
    args = parser.parse_args()
    if args.command == "build":
        build(args.path)
        return 0
    return engine(args)


if __name__ == "__main__":
    sys.exit(main())
