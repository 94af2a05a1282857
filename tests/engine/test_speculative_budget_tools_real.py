"""Speculation where the output's rules change mid-way, on the real default model: a thinking
budget (the closing marker forced after it) and tool calls under ``tool_choice`` auto (a lazy
grammar waiting for its trigger). Each gives the same output with prompt-lookup drafts as
without them, and drafts are accepted on both sides of the change: before the budget and in
the answer after it, in the free text before a call and in the call itself."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from inferd import LLM
from inferd.engine.sampling import SamplingParams
from inferd.engine.thinking import ThinkingSpec
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
    prompt = on.model.chat_prompt(COPY)
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
    # Fewer steps than tokens on both sides of the budget: drafts stood before and after it.
    assert accepted > 10
    assert after.steps - before.steps < len(tokens) - accepted + 2
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
            outputs.append(_run(llm, [llm.model.chat_prompt(TEXT_COPY)], [params])[0])
            accepted = _accepted(llm)
    assert outputs[0] == outputs[1]
    assert accepted > 5


LOG = ToolSpec(
    "log",
    "Write an entry in the keeper's log",
    {
        "type": "object",
        "properties": {"entry": {"type": "string"}},
        "required": ["entry"],
    },
)
CALL = '<tool_call>\n{"name": "log", "arguments": {"entry": "the wind, the rain"}}\n</tool_call>'
CALL_COPY = [
    {
        "role": "user",
        "content": "Repeat this text word for word:\n\nThe keeper climbed the stairs at dusk and "
        f"lit the great lamp.\n{CALL}",
    }
]


def test_tool_calls_under_auto_with_drafts(pair: tuple[LLM, LLM]) -> None:
    """A lazy grammar: free text before the call speculates (drafts stop short of the
    trigger), the call is the same tokens and valid, alone and beside a plain request."""
    on, off = pair
    auto = calls_constraint(Hermes(), [LOG], parallel=False, lazy=True)
    params = SamplingParams(max_tokens=80, temperature=0, constraint=auto)
    free_text, call = on.model.chat_prompt(COPY), on.model.chat_prompt(CALL_COPY)
    for prompt in (free_text, call):
        before = _accepted(on)
        fast = _run(on, [prompt], [params])[0]
        accepted = _accepted(on) - before
        assert fast == _run(off, [prompt], [params])[0]
        assert accepted > 5, fast[1]
    assert "<tool_call>" not in fast[1] or fast[1].endswith("</tool_call>"), fast[1]
    prompts = [call, free_text, call]
    mixed = [params, SamplingParams(max_tokens=40, temperature=0), replace(params, max_tokens=30)]
    assert _run(on, prompts, mixed) == _run(off, prompts, mixed)
    assert on.engine.stats().kv_blocks_used == 0
