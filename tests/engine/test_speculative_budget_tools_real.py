"""Speculation where the output's rules change mid-way, on the real default model: a thinking
budget (the closing marker forced after it) and tool calls under ``tool_choice`` auto (a lazy
grammar waiting for its trigger). Each gives the same output with prompt-lookup drafts as
without them, and drafts are accepted on both sides of the change: before the budget and in
the answer after it, in the free text before a trigger and in the grammar's text after it."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from inferd import LLM
from inferd.engine.sampling import SamplingParams
from inferd.engine.thinking import ThinkingSpec
from inferd.structured.constraint import Constraint
from inferd.structured.tool_syntax import ToolSpec
from inferd.structured.tool_syntax.base import calls_constraint
from inferd.structured.tool_syntax.hermes import Hermes
from tests.engine.test_speculative_constrained_real import TEXT_COPY, _accepted, _run, _seeded
from tests.engine.test_speculative_real import COPY

BUDGET = 24


def _thinking(llm: LLM, budget: int = BUDGET) -> ThinkingSpec:
    """The whole reply is reasoning (the prompt opened the block) until ``budget`` tokens."""
    close_ids = tuple(llm.model.tokenizer.encode("</think>"))
    return ThinkingSpec("<think>", "</think>", close_ids, True, budget)


def test_a_thinking_budget_closes_at_the_same_token_with_drafts(pair: tuple[LLM, LLM]) -> None:
    on, off = pair
    spec = _thinking(on)
    prompt = on.model.chat_prompt(COPY).ids
    greedy = SamplingParams(max_tokens=72, temperature=0, ignore_eos=True, thinking=spec)
    before = on.engine.stats()
    fast = _run(on, [prompt], [greedy])[0]
    after = on.engine.stats()
    plain = _run(off, [prompt], [greedy])[0]
    assert fast == plain  # the same tokens, text and finish reason
    tokens = fast[0]
    assert tokens[BUDGET : BUDGET + len(spec.close_ids)] == spec.close_ids  # forced at the budget
    assert "</think>" not in on.model.tokenizer.decode(list(tokens[:BUDGET]))
    accepted = after.speculative_accepted - before.speculative_accepted
    assert after.steps - before.steps < len(tokens) - accepted + 2  # a step per verify
    # Drafts stood inside the budget (the reply cut there), and after it too.
    before_budget = _accepted(on)
    inside = _run(on, [prompt], [replace(greedy, max_tokens=BUDGET)])[0]
    assert inside[0] == tokens[:BUDGET]
    within = _accepted(on) - before_budget
    assert within > 5 and accepted > within + 5
    # Beside free and seeded requests, and a budget the prompt lookup drafts run into at once.
    tight = replace(greedy, thinking=_thinking(on, 3), max_tokens=30)
    free = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = [prompt, prompt, prompt]
    params = [greedy, tight, free]
    batch = _run(on, prompts, params)
    assert batch == _run(off, prompts, params)
    assert batch[0] == fast
    assert batch[1][0][3 : 3 + len(spec.close_ids)] == spec.close_ids
    assert on.engine.stats().kv_blocks_used == 0


def test_a_seeded_thinking_request_with_speculation_on_and_off(smollm2_gguf: Path) -> None:
    """``deterministic``: a seeded sampled request under a budget gives the same tokens with
    speculation on and off, and drafts stood."""
    outputs, accepted = [], 0
    for mode in ("off", "ngram"):
        with LLM(str(smollm2_gguf), speculative=mode, deterministic=True) as llm:
            params = replace(_seeded(11, 64), thinking=_thinking(llm))
            outputs.append(_run(llm, [llm.model.chat_prompt(TEXT_COPY).ids], [params])[0])
            accepted = _accepted(llm)
    assert outputs[0] == outputs[1]
    assert accepted > 5


LOG = ToolSpec(
    "log",
    "Write an entry in the keeper's log",
    {"type": "object", "properties": {"entry": {"type": "string"}}, "required": ["entry"]},
)
# A lazy grammar whose trigger the copied passage reaches (the small model calls no tools): free
# text up to "the colour", then the grammar to the sentence's end.
MIDWAY = Constraint.lark('start: "the colour" /[a-z ,]+/ "."', triggers=("the colour",))


def test_lazy_grammars_speculate_before_and_after_their_trigger(pair: tuple[LLM, LLM]) -> None:
    """Drafts stop short of the trigger while the grammar waits, the token completing it is
    chosen under the waiting mask, and the grammar's own text drafts after it: the same tokens
    as without speculation, alone and beside other requests; the tool-call grammar of
    ``tool_choice`` auto speculates over a reply that calls nothing."""
    on, off = pair
    prompt = on.model.chat_prompt(COPY).ids
    midway = SamplingParams(max_tokens=80, temperature=0, constraint=MIDWAY)
    before = _accepted(on)
    fast = _run(on, [prompt], [midway])[0]
    accepted = _accepted(on) - before
    assert fast == _run(off, [prompt], [midway])[0]
    assert fast[2] == "stop"  # the grammar completed
    head, tail = fast[1].split("the colour", 1)  # the trigger came, the grammar held after it
    assert re.fullmatch("[a-z ,]+[.]", tail), tail
    # Drafts stood while waiting (the reply cut before the trigger), and after it too.
    waiting = len(on.model.tokenizer.encode(head)) - 2
    before = _accepted(on)
    early = _run(on, [prompt], [replace(midway, max_tokens=waiting)])[0]
    assert early[0] == fast[0][:waiting]
    within = _accepted(on) - before
    assert within > 5 and accepted > within + 5

    auto = calls_constraint(Hermes(), [LOG], parallel=False, lazy=True)
    tools = SamplingParams(max_tokens=60, temperature=0, constraint=auto)
    before = _accepted(on)
    assert _run(on, [prompt], [tools]) == _run(off, [prompt], [tools])
    assert _accepted(on) - before > 5
    prompts = [prompt, prompt, on.model.chat_prompt(TEXT_COPY).ids, prompt]
    seeded = replace(_seeded(3, 80), constraint=MIDWAY)
    mixed = [midway, tools, SamplingParams(max_tokens=40, temperature=0), seeded]
    batch = _run(on, prompts, mixed)
    assert batch[:3] == _run(off, prompts[:3], mixed[:3])
    assert batch[0] == fast
    sampled = batch[3][1]  # sampled: the grammar holds after the trigger wherever it comes
    assert "the colour" not in sampled or re.fullmatch(
        "[a-z ,]+[.]", sampled.split("the colour", 1)[1]
    )
    assert on.engine.stats().kv_blocks_used == 0
