"""The Hermes tool-call syntax: the grammar (strict and lazy) on the real SmolLM2 vocabulary,
and the streaming reader, fed in every chunk size."""

from __future__ import annotations

import json

import pytest

from inferd.loading.tokenizer import TokenizerBundle
from inferd.structured.compiler import GrammarCompiler
from inferd.structured.hermes import CallReader, ToolSpec, call_text, calls_constraint
from inferd.structured.vocabulary import Vocabulary

WEATHER = ToolSpec(
    "get_weather",
    "the weather in a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
)
PING = ToolSpec("ping", "", {"type": "object", "properties": {}})
CALL = call_text("get_weather", '{"city": "Paris"}')
TWO = CALL + "\n" + call_text("ping", "{}")


def _walk(compiler: GrammarCompiler, tok: TokenizerBundle, lazy: bool, text: str) -> bool:
    matcher = compiler.matcher(calls_constraint([WEATHER, PING], parallel=True, lazy=lazy))
    return all(matcher.consume(t) for t in tok.encode(text)) and matcher.accepting


@pytest.mark.parametrize(
    ("lazy", "text", "valid"),
    [
        (False, CALL, True),
        (False, TWO, True),
        (False, "Sure. " + CALL, False),  # required: nothing but calls
        (False, CALL.replace("get_weather", "get_time"), False),
        (False, CALL.replace('"city"', '"town"'), False),
        (True, "No call needed.", True),  # auto: free text is fine
        (True, "Sure. " + TWO, True),
        (True, "Sure. " + CALL.replace("get_weather", "get_time"), False),
        (True, "Sure. " + CALL + " and more text", False),  # nothing after the calls
    ],
)
def test_the_grammar_admits_exactly_valid_calls(
    smollm2_vocabulary: Vocabulary,
    smollm2_tokenizer: TokenizerBundle,
    lazy: bool,
    text: str,
    valid: bool,
) -> None:
    compiler = GrammarCompiler(smollm2_vocabulary)
    assert _walk(compiler, smollm2_tokenizer, lazy, text) is valid


@pytest.mark.parametrize("step", [1, 2, 3, 5, 8, 1000])
def test_the_reader_splits_content_and_calls_in_any_chunking(step: int) -> None:
    output = "Let me check." + TWO
    reader = CallReader()
    content, pieces = "", []
    for i in range(0, len(output), step):
        text, new = reader.feed(output[i : i + step])
        content += text
        pieces += new
    assert content + reader.finish() == "Let me check."
    assert reader.names == ["get_weather", "ping"]
    assert [json.loads(a) for a in reader.arguments] == [{"city": "Paris"}, {}]
    names = [(p.index, p.name) for p in pieces if p.name is not None]
    assert names == [(0, "get_weather"), (1, "ping")]  # each name exactly once
    for index, args in enumerate(reader.arguments):
        assert "".join(p.arguments for p in pieces if p.index == index) == args


def test_a_partial_tag_at_the_end_is_released_as_content() -> None:
    reader = CallReader()
    assert reader.feed("a <tool") == ("a ", [])
    assert reader.finish() == "<tool"
