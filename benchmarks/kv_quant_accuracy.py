"""How much an int8 KV cache changes the model's predictions: teacher-forced logits of a long
text with the KV cache in int8 against the same with the cache in bf16 (the model's dtype).

The text (built below, deterministically, from sentences written for this benchmark) is run
through the model in 512-token chunks, as the server prefills a prompt, writing its keys and
values into a paged cache of each dtype. Two attention paths read the cache back:

- ``prefill``: the prompt path (SDPA over the chunk's keys, dequantized from int8 rows);
- ``decode``: every position as a one-query decode at its place (the fused decode kernel
  reading int8 rows, as generation does; what ``--deterministic`` runs for prompts too).

For each path it prints the per-position KL divergence KL(bf16 || int8) of the next-token
distributions (mean, median, p99, max) and the top-1 agreement. Run::

    python benchmarks/kv_quant_accuracy.py [--model smollm2] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from inferd import LLM
from inferd.kernels.kv_quant import row_width
from inferd.layers.attention import AttentionMetadata, PrefillChunk, chunk_mask
from inferd.layers.linear import dense_rows

BLOCK = 16
CHUNK = 512

SUBJECTS = [
    "The old ferryman",
    "A young botanist",
    "The village baker",
    "Our neighbour's daughter",
    "The harbour master",
    "A travelling clockmaker",
    "The schoolteacher",
    "An elderly beekeeper",
]
ACTIONS = [
    "walked along the river before sunrise",
    "counted the boats that came in with the tide",
    "wrote a long letter to a friend in the city",
    "repaired the broken gate at the end of the lane",
    "planted a row of pear trees behind the chapel",
    "listened to the rain on the slate roof",
    "sold bread and honey at the Saturday market",
    "read an old map of the valley by candlelight",
]
DETAILS = [
    "because the winter had been unusually long",
    "while the church bell rang the hour",
    "although nobody had asked for help",
    "and then sat down to rest by the fire",
    "as the fog slowly lifted from the hills",
    "without saying a word to anyone",
    "so that the children could see how it was done",
    "and remembered the summers of years ago",
]
REFLECTIONS = [
    "Nobody in the village could remember a quieter season.",
    "It is strange how small habits shape a whole life.",
    "The swallows returned in April, as they always did.",
    "Some said the mill would reopen before the harvest.",
    "In the evenings the lamps were lit one by one along the quay.",
    "Prices at the market had risen, but people still came.",
    "The road to the north was closed for most of March.",
    "Letters took nine days to arrive from the capital.",
]


def build_text(min_words: int = 1800, seed: int = 0) -> str:
    """Paragraphs of varied sentences (a seeded choice of parts): long, deterministic, and not
    one passage repeated (which the model would learn to copy)."""
    rng = random.Random(seed)
    paragraphs, words = [], 0
    while words < min_words:
        sentences = []
        for _ in range(rng.randint(4, 7)):
            if rng.random() < 0.25:
                sentences.append(rng.choice(REFLECTIONS))
            else:
                year = rng.randint(1850, 1930)
                sentences.append(
                    f"In {year}, {rng.choice(SUBJECTS).lower()} {rng.choice(ACTIONS)} "
                    f"{rng.choice(DETAILS)}."
                )
        paragraph = " ".join(sentences)
        paragraphs.append(paragraph)
        words += len(paragraph.split())
    return "\n\n".join(paragraphs)


def _caches(llm: LLM, dtype: torch.dtype, blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    config = llm.engine.model.config
    shape = (blocks, BLOCK, config.num_kv_heads, row_width(config.head_dim, dtype))
    return [
        (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        for _ in range(config.num_layers)
    ]


@torch.inference_mode()
def logits_of(llm: LLM, ids: list[int], dtype: torch.dtype, path: str) -> torch.Tensor:
    """[len(ids), vocab] float32: each position's next-token logits, the text run in chunks
    over a paged cache of ``dtype`` (blocks 1.. in order; block 0 is the null block)."""
    model = llm.engine.model
    n = len(ids)
    caches = _caches(llm, dtype, n // BLOCK + 2)
    table = torch.arange(1, n // BLOCK + 2)
    out = []
    for start in range(0, n, CHUNK):
        count = min(CHUNK, n - start)
        positions = torch.arange(start, start + count)
        slots = table[positions // BLOCK] * BLOCK + positions % BLOCK
        if path == "prefill":
            chunk = PrefillChunk(0, count, start, table, chunk_mask(start, count))
            meta = AttentionMetadata(slots, None, None, None, (chunk,))
        else:  # each row a one-query decode at its position
            meta = AttentionMetadata(
                slots, torch.arange(count), table.repeat(count, 1), positions + 1, ()
            )
        with dense_rows():
            hidden = model(torch.tensor(ids[start : start + count]), positions, meta, caches)
            out.append(model.compute_logits(hidden).float())
    return torch.cat(out)


def compare(reference: torch.Tensor, quant: torch.Tensor) -> dict[str, float]:
    """KL(reference || quant) per position and top-1 agreement, over all but the last row
    (it predicts past the text)."""
    reference, quant = reference[:-1], quant[:-1]
    logp, logq = reference.log_softmax(-1), quant.log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    agree = (reference.argmax(-1) == quant.argmax(-1)).float()
    return {
        "kl_mean": float(kl.mean()),
        "kl_median": float(kl.median()),
        "kl_p99": float(kl.quantile(0.99)),
        "kl_max": float(kl.max()),
        "top1": float(agree.mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=2048, help="positions scored (>= 2000)")
    args = parser.parse_args()
    with LLM(args.model) as llm:
        tokenizer = llm.model.tokenizer.tokenizer
        ids = tokenizer.encode(build_text()).ids
        assert len(ids) >= args.tokens, f"the text has only {len(ids)} tokens"
        ids = ids[: args.tokens]
        model_dtype = llm.model.dtype
        print(f"model {args.model} ({model_dtype}), {len(ids)} positions, chunks of {CHUNK}")
        print("| compared | KL mean | KL median | KL p99 | KL max | top-1 agreement |")
        print("|---|---|---|---|---|---|")
        references = {}
        for path in ("prefill", "decode"):
            started = time.perf_counter()
            references[path] = logits_of(llm, ids, model_dtype, path)
            quant = logits_of(llm, ids, torch.int8, path)
            _row(f"{path}: int8 vs bf16 cache", compare(references[path], quant), started)
        # The noise floor: the same bf16 cache read by the two paths (other kernels, other
        # rounding) already differs by this much.
        baseline = compare(references["prefill"], references["decode"])
        _row("bf16 cache: prefill vs decode path", baseline, time.perf_counter())


def _row(name: str, r: dict[str, float], started: float) -> None:
    print(
        f"| {name} | {r['kl_mean']:.5f} | {r['kl_median']:.5f} | {r['kl_p99']:.4f} | "
        f"{r['kl_max']:.4f} | {r['top1']:.2%} |  ({time.perf_counter() - started:.0f} s)"
    )


if __name__ == "__main__":
    main()
