"""Decode throughput of 16 streams on SmolLM2: base model only vs a mix of three LoRA adapters
(rank 16, all seven targets, random weights) and the base, in one engine, in process.

    .venv/bin/python benchmarks/lora.py [ROUNDS]

Each round runs both batches back to back (so load drifts hit both); the best round of each is
kept. Prints generated tokens per second (prefill included) and the cost of the adapters.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from inferd import LLM, SamplingParams
from inferd.loading.lora import LoraAdapter, attach
from inferd.models.llama import LlamaForCausalLM

PROMPT = "Write a long story about a lighthouse keeper."
TOKENS = 32
STREAMS = 16
RANK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = ("a", "b", "c")


def random_adapter(model: LlamaForCausalLM, name: str, seed: int) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    dtype = model.embed_tokens.weight.dtype
    weights = {}
    for layer in range(model.config.num_layers):
        for target in TARGETS:
            linear, _, width = model.lora_target(layer, target)
            a = torch.randn(RANK, linear.in_features, generator=g) / linear.in_features**0.5
            b = torch.randn(width, RANK, generator=g) * 0.01
            weights[(layer, target)] = (a.to(dtype), b.to(dtype))
    return LoraAdapter(name, Path("random"), RANK, 2.0, weights, digest=f"random-{seed}")


def tokens_per_second(llm: LLM, loras: list[str | None]) -> float:
    prompts = [
        llm.model.chat_prompt([{"role": "user", "content": f"{PROMPT} Part {i}."}]).ids
        for i in range(len(loras))
    ]
    params = [
        SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, lora=lora)
        for lora in loras
    ]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return len(loras) * TOKENS / (time.perf_counter() - start)


def main(rounds: int = 2) -> None:
    llm = LLM("smollm2", prefix_caching=False)
    model = llm.engine.model
    keys: list[str | None] = []  # rows name an adapter by its key (name@digest)
    for i, name in enumerate(ADAPTERS):
        adapter = random_adapter(model, name, i)
        attach(model, adapter)
        keys.append(adapter.key)
    batches: dict[str, list[str | None]] = {
        "base only": [None] * STREAMS,
        "3 adapters + base": [(*keys, None)[i % 4] for i in range(STREAMS)],
    }
    tokens_per_second(llm, [None, keys[0]])  # warm up
    best = dict.fromkeys(batches, 0.0)
    for _ in range(rounds):
        for label, loras in batches.items():
            best[label] = max(best[label], tokens_per_second(llm, loras))
    base = best["base only"]
    print(f"| {STREAMS} streams | tokens/s | vs base only |")
    print("|---|---|---|")
    for label, value in best.items():
        print(f"| {label} | {value:.1f} | {value / base - 1:+.0%} |")
    llm.shutdown()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
