"""Single-stream greedy tokens/s with speculation off, prompt lookup and self-speculation.

    .venv/bin/python benchmarks/speculative.py [ROUNDS] [K ...]

Workloads: ``copy`` (the model repeats a ~250-token passage given in its prompt) and ``free``
(a story: little to look up, so the per-request off switch should keep it at the speed of
speculation off). One engine per setting (off, and ngram and self with each K; default K: 3;
self drafts with the first half of the model's layers, engine/draft_model.py), the
default dtype, stepped on this thread, no prefix cache; each round runs every setting back to
back (load drifts hit all), and the median over rounds is printed, with the acceptance rate
(accepted / drafted tokens) and the greedy text's agreement with speculation off.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from inferd import LLM, SamplingParams

PASSAGE = (
    "The lighthouse stood on a ledge of black rock at the end of the headland, and for a hundred "
    "and twelve years a keeper had climbed its spiral stairs every evening at dusk. He trimmed "
    "the wick, polished the great lens until it shone, and wound the clockwork that turned it, "
    "so that ships far out at sea could count the flashes and know which coast they were "
    "passing. In the mornings he wrote in the log: the direction and strength of the wind, the "
    "height of the swell, the colour of the sky, the names of the ships that had passed in the "
    "night, and anything else worth remembering, such as the winter the seals came ashore in "
    "their hundreds, or the night a schooner lost her mast and was towed into the harbour by "
    "the lifeboat. The log books filled a whole shelf in the keeper's cottage, bound in green "
    "cloth, the oldest so faded that the ink had turned the colour of weak tea."
)
WORKLOADS = {
    "copy": (f"Repeat the following text exactly, word for word:\n\n{PASSAGE}", 256),
    "free": ("Write a long story about a violin maker who lives by the sea.", 128),
}


def run(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, tuple[int, ...]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return len(out.token_ids) / (time.perf_counter() - start), out.token_ids


def main(rounds: int = 3, *ks: int) -> None:
    settings: dict[str, dict[str, Any]] = {"off": {"speculative": "off"}}
    for k in ks or (3,):
        settings[f"ngram k={k}"] = {"speculative": "ngram", "num_speculative_tokens": k}
        settings[f"self k={k}"] = {"speculative": "self", "num_speculative_tokens": k}
    engines = {name: LLM("smollm2", prefix_caching=False, **o) for name, o in settings.items()}
    first = next(iter(engines.values()))
    prompts = {
        name: (first.model.chat_prompt([{"role": "user", "content": text}]).ids, n)
        for name, (text, n) in WORKLOADS.items()
    }
    for llm in engines.values():
        run(llm, prompts["free"][0], 8)  # warm up
    print("| workload | setting | median tokens/s | vs off | accepted/drafted | same text |")
    print("|---|---|---|---|---|---|")
    for workload, (prompt, n) in prompts.items():
        speeds: dict[str, list[float]] = {name: [] for name in engines}
        texts: dict[str, tuple[int, ...]] = {}
        before = {name: llm.engine.stats() for name, llm in engines.items()}
        for _ in range(rounds):
            for name, llm in engines.items():
                speed, texts[name] = run(llm, prompt, n)
                speeds[name].append(speed)
        base = statistics.median(speeds["off"])
        for name, llm in engines.items():
            stats, was = llm.engine.stats(), before[name]
            drafted = stats.speculative_drafted - was.speculative_drafted
            accepted = stats.speculative_accepted - was.speculative_accepted
            rate = f"{accepted}/{drafted}" if drafted else "-"
            median = statistics.median(speeds[name])
            same = texts[name] == texts["off"]
            ratio = median / base
            print(f"| {workload} | {name} | {median:.1f} | {ratio:.2f}x | {rate} | {same} |")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
