"""Speculation for constrained and seeded sampled requests, on the real default model.

Constrained greedy output (a JSON schema, a regex) is the same tokens with prompt-lookup drafts
as without, on prompts that copy given text so drafts are accepted, and it validates; a stop
string cuts it at the same place. A seeded sampled request (free or constrained) gives the same
text with speculation on or off, alone, in a batch and again (bit-exact under
``deterministic``). Every KV block goes back after.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema

from inferd import LLM
from inferd.engine.sampling import SamplingParams
from inferd.structured.constraint import Constraint

RECORD = {
    "name": "Ada Lovelace",
    "city": "London",
    "born": 1815,
    "notes": "wrote the first published program, for the Analytical Engine",
}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string"},
        "born": {"type": "integer"},
        "notes": {"type": "string"},
    },
    "required": ["name", "city", "born", "notes"],
    "additionalProperties": False,
}
JSON_COPY = [
    {"role": "user", "content": f"Return this JSON object exactly as it is:\n{json.dumps(RECORD)}"}
]
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp and wrote in "
    "his log the wind, the rain, the colour of the sea, and the names of the ships that passed."
)
TEXT_COPY = [{"role": "user", "content": f"Repeat this text word for word:\n\n{PASSAGE}"}]
# Sentences of lower-case words: the passage fits, and the grammar still cuts drafts.
SENTENCE = r"The [a-z ,]+\."


def _greedy(constraint: Constraint, max_tokens: int = 80, **extra: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0, logprobs=1, constraint=constraint, **extra
    )


def _seeded(seed: int, max_tokens: int, constraint: Constraint | None = None) -> SamplingParams:
    # 0.5: sampled, yet the model still copies the text (at 0.8 it wanders off the passage)
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.5, seed=seed, logprobs=1, constraint=constraint
    )


Result = tuple[tuple[int, ...], str, str | None]


def _run(llm: LLM, prompts: Sequence[list[int]], params: Sequence[SamplingParams]) -> list[Result]:
    outs = llm.generate(list(prompts), list(params), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def _accepted(llm: LLM) -> int:
    return llm.engine.stats().speculative_accepted


def test_constrained_greedy_output_is_unchanged_by_speculation(pair: tuple[LLM, LLM]) -> None:
    on, off = pair
    json_prompt, text_prompt = (
        on.model.chat_prompt(JSON_COPY).ids,
        on.model.chat_prompt(TEXT_COPY).ids,
    )
    cases = [
        (json_prompt, _greedy(Constraint.json_schema(SCHEMA), 80)),
        (text_prompt, _greedy(Constraint.regex(SENTENCE), 60)),
    ]
    for prompt, params in cases:
        before = _accepted(on)
        fast = _run(on, [prompt], [params])[0]
        accepted = _accepted(on) - before
        plain = _run(off, [prompt], [params])[0]
        assert fast == plain  # the same tokens, text and finish reason
        assert accepted > 5, params.constraint  # drafts were accepted under the grammar
        assert fast[2] == "stop"  # the constraint completed
    json_text = _run(on, [json_prompt], [cases[0][1]])[0][1]
    jsonschema.validate(json.loads(json_text), SCHEMA)
    assert re.fullmatch(SENTENCE, _run(on, [text_prompt], [cases[1][1]])[0][1])
    assert off.engine.stats().speculative_drafted == 0
    assert on.engine.stats().kv_blocks_used == 0


def test_constrained_batch_and_stop_string(pair: tuple[LLM, LLM]) -> None:
    """Constrained speculating requests beside free ones and each other, and a stop string
    inside the constrained text: the same outputs as without speculation."""
    on, off = pair
    json_prompt, text_prompt = (
        on.model.chat_prompt(JSON_COPY).ids,
        on.model.chat_prompt(TEXT_COPY).ids,
    )
    regex = _greedy(Constraint.regex(SENTENCE), 60)
    stopped = replace(regex, stop=("the colour",))
    free = SamplingParams(max_tokens=40, temperature=0, logprobs=1)
    prompts = [json_prompt, text_prompt, text_prompt, text_prompt]
    params = [_greedy(Constraint.json_schema(SCHEMA), 80), regex, stopped, free]
    before = _accepted(on)
    fast = _run(on, prompts, params)
    assert _accepted(on) > before
    plain = _run(off, prompts, params)
    assert fast == plain
    assert fast[2][2] == "stop" and "the colour" not in fast[2][1]
    assert fast[2][1] == fast[1][1][: len(fast[2][1])]  # the stop cut the same text short
    assert on.engine.stats().kv_blocks_used == 0


def test_seeded_sampled_text_is_the_same_again_and_in_a_batch(pair: tuple[LLM, LLM]) -> None:
    """Default mode: a seeded request speculates (drafts accepted) and a retry gives its text
    again; constrained seeded outputs validate."""
    on, _ = pair
    text_prompt, json_prompt = (
        on.model.chat_prompt(TEXT_COPY).ids,
        on.model.chat_prompt(JSON_COPY).ids,
    )
    # At temperature 0.5 a seed may wander off the passage (then nothing drafts): over a few
    # seeds most copy it.
    before = _accepted(on)
    seeds = (1, 2, 3, 5)
    first = _run(on, [text_prompt] * len(seeds), [_seeded(s, 32) for s in seeds])
    assert _accepted(on) - before > 5
    for seed, text in zip(seeds, first, strict=True):
        assert _run(on, [text_prompt], [_seeded(seed, 32)])[0] == text
    constrained = [_seeded(s, 80, Constraint.json_schema(SCHEMA)) for s in range(2)]
    before = _accepted(on)
    for _, text, reason in _run(on, [json_prompt] * 2, constrained):
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    assert _accepted(on) > before
    assert on.engine.stats().kv_blocks_used == 0


def test_deterministic_seeded_text_with_speculation_on_and_off(smollm2_gguf: Path) -> None:
    """``deterministic``: a seeded sampled request, free or constrained, gives the same tokens
    with speculation on and off, alone and in a batch beside other requests."""
    options: dict[str, Any] = {"deterministic": True}
    schema = Constraint.json_schema(SCHEMA)
    with LLM(str(smollm2_gguf), speculative="off", **options) as off:
        text_prompt, json_prompt = (
            off.model.chat_prompt(TEXT_COPY).ids,
            off.model.chat_prompt(JSON_COPY).ids,
        )
        prompts = [text_prompt, json_prompt]
        params = [_seeded(5, 24), _seeded(7, 32, schema)]
        plain = [_run(off, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
    with LLM(str(smollm2_gguf), speculative="ngram", **options) as on:
        alone = [_run(on, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
        accepted = _accepted(on)
        batch = _run(on, prompts, params)
        assert _accepted(on) > accepted > 5
        assert on.engine.stats().kv_blocks_used == 0
    assert alone == plain
    assert batch == plain
