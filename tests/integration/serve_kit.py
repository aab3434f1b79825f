#!/usr/bin/env python3
"""Small random-weight models for ``transformers serve`` built offline, and plain
transformers' tokens for a prompt, for tests/integration/test_transformers_serve_gpu.py.

    serve_kit.py build DIR --arch qwen3|mistral     # config, float32 weights (seeded), word tokenizer
    serve_kit.py plain DIR --prompt "t5 t9" --tokens 8 --num-blocks 64 --max-batch-tokens 256 --out out.json

A model directory holds what ``transformers serve MODEL`` loads: the config (from
transformers' own config classes), the weights and a word-level tokenizer whose word
``t<i>`` is token ``i`` (``<unk>`` 0, ``<eos>`` 1), so that a completion's text names its
token ids. ``plain`` runs the prompt through transformers' continuous-batching manager
with no gpumemd, as serve's completion handler does (the model's generation config,
greedy, ``max_new_tokens``), and writes the generated token ids.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

VOCAB = 1024


def build(path: Path, arch: str) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    common = {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "max_position_embeddings": 2048, "bos_token_id": None, "eos_token_id": 1, "pad_token_id": 0}
    if arch == "qwen3":
        model_cls, config = Qwen3ForCausalLM, Qwen3Config(num_key_value_heads=2, head_dim=64, **common)
    else:  # every layer sliding: another KV layout (another head size, sliding groups)
        model_cls, config = MistralForCausalLM, MistralConfig(num_key_value_heads=1, head_dim=32, sliding_window=128, **common)
    torch.manual_seed({"qwen3": 0, "mistral": 1}[arch])
    model = model_cls(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=1, pad_token_id=0)
    model.save_pretrained(str(path))
    vocab = {"<unk>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>", pad_token="<unk>").save_pretrained(str(path))


def plain(path: Path, prompt: str, tokens: int, num_blocks: int, max_batch_tokens: int) -> list[int]:
    """The tokens transformers' manager generates for ``prompt`` on CUDA, as serve asks
    for them (its ``CBGenerateManager``: the request's generation config, then
    ``add_request`` with its ``max_new_tokens`` and ``eos_token_id``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, device_map="cuda")
    ids = AutoTokenizer.from_pretrained(str(path))(prompt)["input_ids"]
    gen = copy.deepcopy(model.generation_config)
    gen.max_new_tokens, gen.do_sample, gen.use_cache = tokens, False, False
    cb = ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    try:
        request = manager.add_request(ids, max_new_tokens=tokens, eos_token_id=gen.eos_token_id)
        while (result := manager.get_result(request_id=request, timeout=120)) is None or not result.is_finished():
            if result is None:
                raise RuntimeError(f"no result for the plain request within 120 s (running: {manager.is_running()})")
        if result.error:
            raise RuntimeError(f"the plain request failed: {result.error}")
        return list(result.generated_tokens)
    finally:
        manager.stop(block=True, timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("command", choices=["build", "plain"])
    parser.add_argument("path", type=Path)
    parser.add_argument("--arch", choices=["qwen3", "mistral"], default="qwen3")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.command == "build":
        build(args.path, args.arch)
    else:
        out = plain(args.path, args.prompt, args.tokens, args.num_blocks, args.max_batch_tokens)
        args.out.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
