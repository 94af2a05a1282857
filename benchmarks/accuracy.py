"""What each fast-path approximation costs in accuracy, against float32, on a fixed text.

    .venv/bin/python benchmarks/accuracy.py [MODEL]

The default model (SmolLM2-135M-Instruct) reads a fixed ~300-token English text. The reference is
the dense float32 model; each bf16 regime the engine can run a row through is then forced on
every row:

- dense bf16: prompt rows, batches above 8 rows, and every row under ``--deterministic``;
- packed rows (int4 weights in groups of 32 where the GGUF had 4-bit groups, int8 per output
  row otherwise, SmolLM2's output head and Gemma 3's Q4_K/Q6_K layers): batches of at most 8 rows
  (decode) where the VNNI kernels do not run (``INFERD_INT4_INT8=0``, or a CPU without AVX-512
  VNNI);
- packed x int8 rows (int4 or int8 weights in groups of 32, each row quantized to int8 per group
  of 32): decode batches of up to ``linear.INT4_INT8_ROWS`` rows on the VNNI build, the default
  there (shown where it runs).

Prints, per regime, the mean KL(f32 || regime) of the next-token distributions, the share of
positions whose top-1 token matches float32, and the perplexity of the text. The README's table
("Determinism and fast-path accuracy") is this script's output.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from inferd.kernels import INT4_INT8_ENV, int8_dot, load_ops
from inferd.layers.attention import AttentionMetadata, PrefillChunk, chunk_mask
from inferd.layers.linear import dense_rows, packed_rows
from inferd.loading.model import load
from inferd.models.llama import LlamaForCausalLM
from inferd.source import resolve_source

TEXT = (
    "The lighthouse stood at the end of a long stone pier, and for forty years the same family "
    "had kept its lamp burning. Every evening at dusk the keeper climbed the one hundred and "
    "twelve steps of the spiral staircase, trimmed the wick, polished the great lens, and wound "
    "the clockwork that turned the light. Ships passing along the coast counted the flashes to "
    "know which headland they were passing: three short flashes and a long pause meant the rocks "
    "of the northern point, where many vessels had been lost before the tower was built.\n\n"
    "In the winter the storms came from the west. Waves broke over the pier and threw spray as "
    "high as the gallery, and the keeper would sit by the window with a cup of tea, listening to "
    "the wind and writing in the logbook. He recorded the direction of the wind, the state of "
    "the sea, the ships he saw, and anything unusual: a flock of birds resting on the rail, a "
    "fishing boat that came in late, a strange light far out on the water that never came "
    "closer.\n\nWhen electricity finally reached the village, engineers arrived to install an "
    "automatic lamp. The keeper showed them the old machinery, explained how the weights fell "
    "through the centre of the tower, and asked whether the new light would still flash three "
    "times and pause. They assured him that it would."
)
BLOCK = 16


def forward(model: LlamaForCausalLM, ids: list[int], chunk: int) -> torch.Tensor:
    """Float32 logits of every position, prefilled ``chunk`` rows per forward."""
    cfg, n = model.config, len(ids)
    blocks = -(-n // BLOCK)
    shape = (blocks + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    dtype = model.embed_tokens.weight.dtype
    caches = [
        (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        for _ in range(cfg.num_layers)
    ]
    table = torch.arange(1, blocks + 1)
    out = []
    with torch.inference_mode():
        for start in range(0, n, chunk):
            pos = torch.arange(start, min(start + chunk, n))
            meta = AttentionMetadata(
                slot_mapping=table[pos // BLOCK] * BLOCK + pos % BLOCK,
                decode_rows=None,
                decode_block_tables=None,
                decode_lens=None,
                prefills=(PrefillChunk(0, len(pos), start, table, chunk_mask(start, len(pos))),),
            )
            hidden = model(torch.tensor(ids[start : start + len(pos)]), pos, meta, caches)
            out.append(model.compute_logits(hidden).float())
    return torch.cat(out)


def compare(ref: torch.Tensor, other: torch.Tensor, ids: list[int]) -> tuple[float, float, float]:
    """(mean KL(ref || other), top-1 agreement, perplexity of ``other`` on the text)."""
    p, q = ref.log_softmax(-1), other.log_softmax(-1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    top1 = float((p.argmax(-1) == q.argmax(-1)).float().mean())
    targets = torch.tensor(ids[1:])[:, None]
    ppl = math.exp(-float(q[:-1].gather(1, targets).mean()))
    return kl, top1, ppl


def main(model_id: str = "smollm2") -> None:
    source = resolve_source(model_id)
    f32 = load(source, dtype="f32", progress=False)
    os.environ[INT4_INT8_ENV] = "0"  # read when the weights are packed: torch's int4 copies
    bf16 = load(source, dtype="bf16", progress=False)
    os.environ[INT4_INT8_ENV] = "1"  # the int4 x int8 kernel's copies, where it runs
    vnni = load(source, dtype="bf16", progress=False) if int8_dot(torch.bfloat16) else None
    for loaded in (f32, bf16, vnni):
        if loaded is not None:
            loaded.model.use_kernels(load_ops(loaded.dtype))
    ids = f32.tokenizer.encode(TEXT, add_special=False)
    ref = forward(f32.model, ids, len(ids))
    model = bf16.model
    regimes: list[tuple[str, Callable[[], AbstractContextManager[None]]]] = [
        ("dense bf16 (prompts, > 8 rows, --deterministic)", dense_rows),
        ("packed weights, bf16 rows (batches <= 8)", packed_rows),
    ]
    if vnni is not None:
        runs = [(name, model, regime) for name, regime in regimes]
        runs.append(("packed weights x int8 rows (VNNI)", vnni.model, packed_rows))
    else:
        runs = [(name, model, regime) for name, regime in regimes]
    print(f"{source.name}: {len(ids)} tokens; reference: dense float32\n")
    print("| regime | KL vs f32 | top-1 agreement | perplexity |")
    print("|---|---|---|---|")
    print(f"| dense float32 (reference) | 0 | 1.000 | {compare(ref, ref, ids)[2]:.3f} |")
    for name, run_model, regime in runs:
        with regime():
            logits = forward(run_model, ids, 8)
        kl, top1, ppl = compare(ref, logits, ids)
        print(f"| {name} | {kl:.4f} | {top1:.3f} | {ppl:.3f} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
