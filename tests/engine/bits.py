"""What engine tests compare between two runs of a request: equal only where the logits' bits
were (token ids and each one's logprob), with the text and why it ended."""

from __future__ import annotations

from collections.abc import Sequence

from inferd import LLM, RequestOutput, SamplingParams

Bits = tuple[tuple[int, ...], tuple[float, ...], str, str | None]


def bits(out: RequestOutput) -> Bits:
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    return c.token_ids, tuple(lp.logprob for lp in c.logprobs), c.text, c.finish_reason


def run_bits(
    llm: LLM, prompts: Sequence[list[int]], params: Sequence[SamplingParams]
) -> list[Bits]:
    """The requests submitted together (one batch where the engine can), in order."""
    return [bits(o) for o in llm.generate(list(prompts), list(params), use_tqdm=False)]
