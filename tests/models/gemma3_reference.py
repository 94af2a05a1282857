"""Write the Gemma 3 oracle fixture: transformers reading the same GGUF, in float32.

Run from the repository root (after ``inferd pull gemma3``)::

    PYTHONPATH=$PWD python tests/models/gemma3_reference.py

It stores ``tests/models/data/gemma3_reference.pt`` (well under 2 MB): for each prompt of
``PROMPTS`` its token ids (transformers' tokenizer, BOS first), the top-1024 logits and the
logsumexp (which sums over the whole vocabulary) of the last position, the top-16 logits of
every position and transformers' greedy continuation (ids and text); and the perplexity of
``PERPLEXITY_TEXT``. The test (tests/models/test_gemma3_parity.py) compares inferd's forward
pass against them, so it needs no transformers model (loading one takes most of a minute).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Émile a écrit 三个字 and an emoji 🙂 — then stopped.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]

# A fixed text of about 150 tokens, repeated (below) to pass the sliding window.
PERPLEXITY_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
    "those used to make wine. Before his invention, books were copied by hand, a slow and "
    "expensive process that kept them in the hands of monasteries, universities and the "
    "very rich. Within fifty years of the first printed Bible, presses were at work in more "
    "than two hundred cities across Europe, and millions of volumes had been produced. The "
    "spread of printing changed how knowledge moved: scholars could compare identical copies "
    "of a text, errors could be corrected in later editions, and ideas travelled faster than "
    "any authority could contain them. Pamphlets fuelled religious and political debates, "
    "scientific results reached colleagues in distant countries, and literacy slowly rose as "
    "cheap books and newspapers became part of everyday life. "
)
# Repeated so the sequence runs past the 512-token sliding window: the window must matter.
PERPLEXITY_REPEATS = 4
TOP_K = 16  # per position
LAST_TOP_K = 1024  # at the last position (the whole 262k row would make the file 4 MB)
FIXTURE = Path(__file__).parent / "data" / "gemma3_reference.pt"


def perplexity_text() -> str:
    return PERPLEXITY_TEXT * PERPLEXITY_REPEATS


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ``ids[1:]`` given the logits before each."""
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    nll = -logp.gather(1, torch.tensor(ids[1:])[:, None]).mean()
    return math.exp(float(nll))


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inferd.store import ModelStore

    path = ModelStore().entry_path("gemma3")
    assert path is not None, "run `inferd pull gemma3` first"
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    text_cfg = getattr(hf.config, "text_config", hf.config)
    print("sliding window", text_cfg.sliding_window, "layers", text_cfg.layer_types)
    prompts: list[dict[str, Any]] = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tok(prompt)["input_ids"]
            logits = hf(torch.tensor([ids])).logits[0].float()
            top = logits.topk(TOP_K, dim=-1)
            last = logits[-1].topk(LAST_TOP_K)
            greedy = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
            prompts.append(
                {
                    "prompt": prompt,
                    "ids": ids,
                    "last_topk_ids": last.indices.to(torch.int32),
                    "last_topk_logits": last.values,
                    "last_logsumexp": float(torch.logsumexp(logits[-1].double(), dim=0)),
                    "topk_ids": top.indices.to(torch.int32),
                    "topk_logits": top.values,
                    "greedy": greedy[0, len(ids) :].tolist(),
                    "greedy_text": tok.decode(greedy[0, len(ids) :], skip_special_tokens=True),
                }
            )
        text_ids = tok(perplexity_text())["input_ids"]
        ppl = perplexity(hf(torch.tensor([text_ids])).logits[0], text_ids)
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "gguf_sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "prompts": prompts,
            "perplexity_ids": text_ids,
            "perplexity": ppl,
        },
        FIXTURE,
    )
    size = FIXTURE.stat().st_size
    print(f"wrote {FIXTURE} ({size} bytes); {len(text_ids)} tokens, ppl {ppl:.4f}")


if __name__ == "__main__":
    main()
