#!/usr/bin/env python3
"""nano-vllm without a network, for bench/engine.py and tests/integration/test_nanovllm_gpu.py.

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
torch.compile turned off and cuBLAS's reproducible workspace setting (the same for both
modes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import types
from pathlib import Path
from typing import Any

LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4, 2048, 8192, 16, 4, 128, 32768
MAX_NUM_SEQS, MAX_MODEL_LEN, MAX_BATCHED = 64, 1024, 8192
PROMPT_SEED = 1234


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
        # No host sync and fixed shapes: this runs inside CUDA-graph capture.
        batch, width = block_table.shape
        blocks = block_table.clamp(min=0)
        k = k_cache[blocks].flatten(1, 2)  # (batch, width * block, kv heads, dim)
        v = v_cache[blocks].flatten(1, 2)
        positions = torch.arange(k.shape[1], device=q.device)
        mask = (positions[None, :] < cache_seqlens[:, None]) | (positions[None, :] == 0)  # padded rows stay finite
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
        """Greedy, with a sampler's temporaries: float logits and probabilities."""

        def forward(self, logits: Any, temperatures: Any, *args: Any, **kwargs: Any) -> Any:
            probs = torch.softmax(logits.float(), dim=-1)
            return probs.argmax(dim=-1)

    return GreedySampler


def install_standins(port: int) -> Any:
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # read by torch at import: this process only
    # cuBLAS picks reproducible algorithms only with a fixed workspace configuration; the
    # runs compare token ids, and random bf16 weights leave near-ties in the logits.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    sys.modules["flash_attn"] = _flash_attn(torch)
    from nanovllm.engine import model_runner
    from nanovllm.models import qwen3

    model_runner.Sampler = greedy_sampler(torch)
    model_runner.find_available_port = lambda *args, **kwargs: port
    get_rope = qwen3.get_rope

    def default_rope(head_size: int, rotary_dim: int, max_position: int, base: float, rope_scaling: Any = None) -> Any:
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", "default") == "default":
            rope_scaling = None
        return get_rope(head_size, rotary_dim, max_position, base, rope_scaling)

    qwen3.get_rope = default_rope
    return torch


# ---------------------------------------------------------------------- one engine


def generate(llm: Any, batch: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, int]:
    """Greedy completions of ``batch`` (in order), the seconds spent in decode steps, and
    the tokens those steps made."""
    from nanovllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    for prompt in batch:
        llm.add_request(prompt, params)
    outputs: dict[int, list[int]] = {}
    decode_s, decode_tokens = 0.0, 0
    while not llm.is_finished():
        started = time.perf_counter()
        finished, tokens = llm.step()
        took = time.perf_counter() - started
        if tokens < 0:
            decode_s += took
            decode_tokens -= tokens
        for seq_id, ids in finished:
            outputs[seq_id] = ids
    return [outputs[k] for k in sorted(outputs)], decode_s, decode_tokens


def sampler_borrowing(torch: Any, mem: Any) -> dict[str, int]:
    """The sampler's temporaries: the reserved peak they add with torch's own allocator,
    and with borrowing from the graph pool's free runs (the borrow pool's segments alias
    graph-pool memory: left out, as gpumem.memory_reserved does)."""
    import gpumem

    sampler = greedy_sampler(torch)()
    with mem.running():
        logits = torch.randn(MAX_NUM_SEQS, VOCAB, device="cuda", dtype=torch.bfloat16)
        temperatures = torch.ones(MAX_NUM_SEQS, device="cuda")
    need = 4 * logits.numel()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    result = sampler(logits, temperatures)  # torch's default allocator: fresh segments
    del result
    plain = torch.cuda.max_memory_reserved() - base
    # The first borrow warms cuBLAS and builds the borrow pool; the copy of its result
    # out of the runs leaves a block cached where steady steps find it.
    mem.borrowed(sampler, logits, temperatures, need_bytes=need)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = gpumem.memory_reserved()
    aliases = torch.cuda.memory_reserved() - base
    mem.borrowed(sampler, logits, temperatures, need_bytes=need)
    borrowed = torch.cuda.max_memory_reserved() - aliases - base
    return {"temporaries_bytes": plain, "borrowed_peak_bytes": borrowed, "need_bytes": need}


def engine(args: argparse.Namespace) -> int:
    torch = install_standins(args.port)
    from nanovllm import LLM

    if args.mode == "gpumemd":
        from gpumem.integrations import nanovllm as integration

        integration.enable(args.name, expect=args.expect, runtime_dir=args.runtime_dir, headroom_bytes=args.headroom << 20)
    out: dict[str, Any] = {"mode": args.mode, "name": args.name, "pid": os.getpid()}
    started = time.perf_counter()
    llm = LLM(args.model, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_BATCHED,
              gpu_memory_utilization=args.util)
    out["startup_s"] = time.perf_counter() - started
    runner = llm.model_runner
    out["blocks"] = runner.config.num_kvcache_blocks
    out["block_bytes"] = 2 * LAYERS * runner.block_size * KV_HEADS * HEAD_DIM * 2
    batch = prompts(args.prompts)
    generate(llm, batch[:8], 4)  # warm: both modes time steady state
    tokens, decode_s, decode_tokens = generate(llm, batch, args.tokens)
    out.update(tokens=tokens, decode_tok_s=decode_tokens / decode_s if decode_s else 0.0)
    if args.mode == "gpumemd":
        import msgspec

        mem = runner._gpumem
        out["model_usage"] = vars(mem.model.usage())
        out["graphs_usage"] = vars(mem.graphs.usage())
        out["kv_budget"] = msgspec.structs.asdict(mem.kv.pool.budget)
        if args.borrow_figures:
            out["sampler"] = sampler_borrowing(torch, mem)
    _write(args.out, out)
    if args.again_after:  # keep serving: once the file appears, generate the same batch again
        while not Path(args.again_after).exists():
            generate(llm, batch[:8], 4)
        again, _, _ = generate(llm, batch, args.tokens)
        differ = [i for i, (x, y) in enumerate(zip(again, tokens)) if x != y]
        _write(args.out + ".again", {"same_tokens": again == tokens, "sequences": len(again), "differ": len(differ)})
    if args.serve_forever:
        while True:
            generate(llm, batch, args.tokens)
    return 0


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
    e.add_argument("--headroom", type=int, default=1024, help="MiB the round leaves free (gpumemd)")
    e.add_argument("--prompts", type=int, default=64)
    e.add_argument("--tokens", type=int, default=64)
    e.add_argument("--borrow-figures", action="store_true")
    e.add_argument("--again-after", default="", help="once this file exists, generate again and compare")
    e.add_argument("--serve-forever", action="store_true")
    args = parser.parse_args()
    if args.command == "build":
        build(args.path)
        return 0
    return engine(args)


if __name__ == "__main__":
    sys.exit(main())
