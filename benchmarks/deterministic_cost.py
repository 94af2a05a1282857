"""Decode throughput with and without ``--deterministic``, at 1 and 16 streams, in process.

    .venv/bin/python benchmarks/deterministic_cost.py [ROUNDS]

A lighter stand-in, for a busy machine, for
``inferd bench --workloads single,concurrent --peers '' [-- --deterministic]``: one engine per
mode (the default dtype), stepped on this thread; each round runs both modes back to back (so
load drifts hit both) and the best round of each is kept.
Prints generated tokens per second (prefill included) and the cost of the deterministic mode.
"""

from __future__ import annotations

import sys
import time

from inferd import LLM, SamplingParams

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
TOKENS = 32


def tokens_per_second(llm: LLM, streams: int) -> float:
    prompts = [
        llm.model.chat_prompt(
            [{"role": "user", "content": f"{PROMPT[0]['content']} Part {i}."}]
        ).ids
        for i in range(streams)
    ]
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return streams * TOKENS / (time.perf_counter() - start)


def main(rounds: int = 3) -> None:
    engines = {
        mode: LLM("smollm2", deterministic=mode, prefix_caching=False) for mode in (False, True)
    }
    for llm in engines.values():
        tokens_per_second(llm, 2)  # warm up
    print("| streams | default tokens/s | --deterministic tokens/s | cost |")
    print("|---|---|---|---|")
    for streams in (1, 16):
        best = {mode: 0.0 for mode in engines}
        for _ in range(rounds):
            for mode, llm in engines.items():
                best[mode] = max(best[mode], tokens_per_second(llm, streams))
        cost = 1 - best[True] / best[False]
        print(f"| {streams} | {best[False]:.1f} | {best[True]:.1f} | {cost:.0%} |")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
