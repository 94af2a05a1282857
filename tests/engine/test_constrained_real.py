"""Constrained decoding on the real default model: sampled at temperature 1 over several seeds,
every output parses and validates; under preemption and recompute it stays exact."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from inferd.config import EngineConfig
from inferd.engine.outputs import RequestOutput
from inferd.engine.sampling import SamplingParams
from inferd.serving.served import ServedModel, load_model
from inferd.source import resolve_source
from inferd.structured.constraint import Constraint

SEEDS = range(16)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "status": {"enum": ["new", "paid", "shipped"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
    },
    "required": ["id", "status", "items", "gift"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served(smollm2_gguf: Path) -> Iterator[ServedModel]:
    """The default model at its default dtype."""
    cfg = EngineConfig(max_num_seqs=8, kv_cache_tokens=8192)
    model = load_model(resolve_source(str(smollm2_gguf)), cfg, progress=False)
    yield model
    model.shutdown()


async def _run(served: ServedModel, prompt: list[int], params: SamplingParams) -> RequestOutput:
    """The whole output as one RequestOutput: all text, the last finish reason."""
    outs = [o async for o in served.engine.generate(prompt, params)]
    text = "".join(o.text for o in outs)
    return RequestOutput(
        outs[-1].request_id,
        text,
        tuple(t for o in outs for t in o.token_ids),
        outs[-1].finish_reason,
        outs[-1].num_prompt_tokens,
        outs[-1].num_output_tokens,
        logprobs=tuple(lp for o in outs for lp in o.logprobs or ()),
    )


def _sampled(
    served: ServedModel, ask: str, constraint: Constraint, **extra: Any
) -> list[RequestOutput]:
    prompt = served.chat_prompt([{"role": "user", "content": ask}]).ids

    async def all_seeds() -> list[RequestOutput]:
        params = [
            SamplingParams(max_tokens=200, temperature=1.0, seed=s, constraint=constraint, **extra)
            for s in SEEDS
        ]
        return list(await asyncio.gather(*(_run(served, prompt, p) for p in params)))

    return asyncio.run(all_seeds())


@pytest.mark.parametrize(
    ("ask", "schema"),
    [
        ("Describe a person as JSON.", None),
        ("Describe a person as JSON.", PERSON),
        ("Make up an online order as JSON.", ORDER),
    ],
    ids=["json_object", "person", "order"],
)
def test_every_sampled_output_parses_and_validates(
    served: ServedModel, ask: str, schema: dict[str, Any] | None
) -> None:
    constraint = Constraint.json_object() if schema is None else Constraint.json_schema(schema)
    outs = _sampled(served, ask, constraint)
    for out in outs:
        if out.finish_reason == "length" and schema is None:
            # Free JSON at temperature 1 may write a number or a string that never ends: no
            # bound ends it, max_tokens does.
            assert out.text.startswith("{"), out.text
            continue
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        jsonschema.validate(value, schema or {"type": "object"})
        if schema is not None:  # properties come in the schema's order
            assert list(value) == list(schema["properties"])[: len(value)]
    # Free JSON at temperature 1 ends within max_tokens about as often as not, and which seeds
    # do moves with the kernels' numerics (16 seeds: 9 with bf16 rows, 12 with int8 rows);
    # fewer than half would be an object the grammar does not let end.
    assert sum(o.finish_reason == "stop" for o in outs) >= len(outs) // 2


def test_regex_and_choice_match_whole_outputs(served: ServedModel) -> None:
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
    for out in _sampled(served, "When is the launch?", Constraint.regex(date)):
        assert re.fullmatch(date, out.text), out.text
    colors = ["red", "green", "light blue"]
    seen = {out.text for out in _sampled(served, "Pick a color.", Constraint.choice(colors))}
    assert seen <= set(colors)


def test_logprobs_of_constrained_tokens_are_finite(served: ServedModel) -> None:
    outs = _sampled(served, "Pick one.", Constraint.choice(["yes", "no"]), logprobs=2)
    for out in outs:
        assert out.logprobs and len(out.logprobs) == len(out.token_ids)
        assert all(lp.logprob > float("-inf") for lp in out.logprobs)


def test_a_constraint_that_does_not_compile_is_refused_when_built(served: ServedModel) -> None:
    from inferd.structured.constraint import ConstraintError

    params = SamplingParams(constraint=Constraint.grammar("start: missing_rule"))
    with pytest.raises(ConstraintError, match="missing_rule"):
        served.engine.submit([1, 2, 3], params)


def test_preempted_constrained_requests_match_their_solo_output(smollm2_gguf: Path) -> None:
    """Recompute replays the prompt and output through the model but feeds the matcher
    nothing twice: the outputs equal the unpreempted ones and still validate. Deterministic, so
    that the recomputed KV is bit for bit the KV the request had (by default its decoded tokens
    come back through the prompt's dense kernels, not the decode's int4 x int8 ones: README,
    "Determinism"), and a difference can only be the matcher's."""
    cfg = EngineConfig(max_num_seqs=4, kv_cache_tokens=160, block_size=16, deterministic=True)
    tiny = load_model(resolve_source(str(smollm2_gguf)), cfg, progress=False)
    try:
        prompts = [
            tiny.chat_prompt([{"role": "user", "content": f"Person number {k} as JSON."}]).ids
            for k in range(4)
        ]
        params = SamplingParams(
            max_tokens=40, temperature=0, constraint=Constraint.json_schema(PERSON)
        )

        async def solo() -> list[str]:
            return [(await _run(tiny, p, params)).text for p in prompts]

        async def together() -> list[str]:
            outs = await asyncio.gather(*(_run(tiny, p, params) for p in prompts))
            return [o.text for o in outs]

        alone = asyncio.run(solo())
        before = tiny.engine.stats().preemptions
        assert asyncio.run(together()) == alone
        assert tiny.engine.stats().preemptions > before
        for text in alone:
            jsonschema.validate(json.loads(text), PERSON)
    finally:
        tiny.shutdown()


def test_a_prefix_cache_hit_keeps_the_constraint(served: ServedModel) -> None:
    """The second identical request reads its prompt from the prefix cache: the same greedy
    output, still valid (the matcher starts fresh whatever the KV holds)."""
    prompt = served.chat_prompt([{"role": "user", "content": "One person, as JSON, please."}]).ids
    params = SamplingParams(max_tokens=60, temperature=0, constraint=Constraint.json_schema(PERSON))
    first = asyncio.run(_run(served, prompt, params))
    hits = served.engine.stats().prefix_cache_hits
    again = asyncio.run(_run(served, prompt, params))
    assert served.engine.stats().prefix_cache_hits > hits
    assert again.text == first.text
    jsonschema.validate(json.loads(again.text), PERSON)


def test_a_stop_string_cuts_the_constrained_output(served: ServedModel) -> None:
    """A stop string ends a constrained reply like any other: what came before it is the start
    of the same valid output the unstopped request writes."""
    prompt = served.chat_prompt([{"role": "user", "content": "A person as JSON."}]).ids
    schema = Constraint.json_schema(PERSON)
    whole = asyncio.run(
        _run(served, prompt, SamplingParams(max_tokens=60, temperature=0, constraint=schema))
    )
    jsonschema.validate(json.loads(whole.text), PERSON)
    cut = asyncio.run(
        _run(
            served,
            prompt,
            SamplingParams(max_tokens=60, temperature=0, constraint=schema, stop=('"age"',)),
        )
    )
    assert cut.finish_reason == "stop"
    assert '"age"' in whole.text and whole.text.startswith(cut.text)
    assert cut.text == whole.text[: whole.text.index('"age"')]
