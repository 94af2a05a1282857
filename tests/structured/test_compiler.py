"""Compiling constraints for the real SmolLM2 vocabulary: errors named, time bounded, cached,
and a matcher that walks a valid output to the end and refuses an invalid one."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from inferd.loading.tokenizer import TokenizerBundle
from inferd.structured.compiler import GrammarCompiler
from inferd.structured.constraint import Constraint, ConstraintError, ConstraintKind
from inferd.structured.masks import MaskJob, unpack
from inferd.structured.matcher import TokenMatcher
from inferd.structured.tool_syntax import ToolSpec
from inferd.structured.tool_syntax.base import calls_constraint
from inferd.structured.tool_syntax.hermes import Hermes
from inferd.structured.vocabulary import Vocabulary

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture
def compiler(smollm2_vocabulary: Vocabulary) -> GrammarCompiler:
    return GrammarCompiler(smollm2_vocabulary)


def _walk(compiler: GrammarCompiler, constraint: Constraint, ids: list[int]) -> bool:
    matcher = compiler.matcher(constraint)
    return all(matcher.consume(t) for t in ids) and matcher.accepting


@pytest.mark.parametrize(
    ("constraint", "good", "bad"),
    [
        (Constraint.json_object(), '{"a": [1, 2]}', '{"a": [1, 2]'),
        (Constraint.json_schema(PERSON), '{"name": "Bo", "age": 3}', '{"age": 3, "name": "Bo"}'),
        (Constraint.regex(r"\d{3}-\d{4}"), "555-1234", "555-123a"),
        (Constraint.choice(["red", "green"]), "green", "blue"),
        (Constraint.grammar('start: "yes" | "no"'), "no", "maybe"),
        (Constraint.grammar('root ::= "yes" | "no"'), "yes", "nope"),  # GBNF
    ],
)
def test_matcher_accepts_valid_text_and_refuses_the_rest(
    compiler: GrammarCompiler,
    smollm2_tokenizer: TokenizerBundle,
    constraint: Constraint,
    good: str,
    bad: str,
) -> None:
    assert _walk(compiler, constraint, smollm2_tokenizer.encode(good))
    assert not _walk(compiler, constraint, smollm2_tokenizer.encode(bad))


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint.grammar("start: foo"), 'unknown name: "foo"'),
        (Constraint.regex("("), "unclosed group"),
        (Constraint.json_schema({"type": "object", "not": {"type": "string"}}), "not"),
    ],
)
def test_compile_errors_name_the_problem(
    compiler: GrammarCompiler, constraint: Constraint, message: str
) -> None:
    with pytest.raises(ConstraintError, match=message):
        compiler.matcher(constraint)
    with pytest.raises(ConstraintError, match=message):  # the failure is cached too
        asyncio.run(compiler.prepare(constraint))


# Each compiles and has a first mask, but the first token sampled under it was refused (the
# forced output is endless or huge): a 500, or a 200 then an error event, before the probe.
FAILS_AT_FIRST_TOKEN = {
    "schema requiring itself": Constraint.json_schema(
        {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}
    ),
    "lark huge repeat": Constraint.grammar('start: "x"{1000000}'),
    "gbnf endless": Constraint.grammar('root ::= a\na ::= "x" a'),
    "forced after a choice": Constraint.grammar('start: ("a" | "b") "x"{1000000}'),
}


@pytest.mark.parametrize("constraint", FAILS_AT_FIRST_TOKEN.values(), ids=FAILS_AT_FIRST_TOKEN)
def test_a_constraint_that_fails_at_its_first_token_is_refused_when_compiled(
    compiler: GrammarCompiler, constraint: Constraint
) -> None:
    with pytest.raises(ConstraintError) as info:
        asyncio.run(compiler.prepare(constraint))
    message = str(info.value)
    assert message.startswith("the constraint fails at its first token"), message
    assert "<state>" not in message and "<grammar>" not in message and len(message) < 200


@pytest.mark.parametrize(
    ("constraint", "text"),
    [
        # without "type": "object" a number or string is an instance: nothing is forced
        (Constraint.json_schema({"properties": {"x": {"$ref": "#"}}, "required": ["x"]}), "7"),
        (Constraint.grammar('start: "x"{2000}'), "x" * 2000),  # long, but forced within bounds
        (Constraint.grammar('start: "a" | "b" "x"{3}'), "bxxx"),
    ],
)
def test_the_first_token_probe_leaves_servable_constraints_alone(
    compiler: GrammarCompiler, smollm2_tokenizer: TokenizerBundle, constraint: Constraint, text: str
) -> None:
    asyncio.run(compiler.prepare(constraint))
    assert _walk(compiler, constraint, smollm2_tokenizer.encode(text))


def test_a_schema_too_slow_to_compile_is_refused_at_the_time_bound(
    smollm2_vocabulary: Vocabulary,
) -> None:
    # 50k enum values (past what schema_check lets through): llguidance needs far more than
    # the bound to build its lexer, and the caller stops waiting at the bound.
    enum = json.dumps({"enum": [f"value number {i}" for i in range(50_000)]})
    hostile = Constraint(ConstraintKind.JSON_SCHEMA, enum)
    compiler = GrammarCompiler(smollm2_vocabulary, timeout=0.01)
    started = time.monotonic()
    with pytest.raises(ConstraintError, match=r"took longer than 0\.01s to compile"):
        asyncio.run(compiler.prepare(hostile))
    waited = time.monotonic() - started
    # While it still compiles, a small constraint on the other compile thread is unaffected.
    compiler.timeout = 30.0
    assert compiler.matcher(Constraint.choice(["a", "b"])) is not None
    assert waited < 30.0
    compiler.shutdown()


def test_compiled_once_then_served_from_the_cache(
    compiler: GrammarCompiler, smollm2_tokenizer: TokenizerBundle
) -> None:
    constraint = Constraint.json_schema(PERSON)
    asyncio.run(compiler.prepare(constraint))
    first = compiler._cached(constraint)
    a, b = compiler.matcher(constraint), compiler.matcher(constraint)
    assert compiler._cached(constraint) is first
    text = smollm2_tokenizer.encode('{"name": "Bo", "age": 3}')
    assert all(a.consume(t) for t in text[:3])
    assert all(b.consume(t) for t in text) and b.accepting  # b did not see a's tokens
    assert not a.accepting


def test_masks_allow_exactly_what_the_matcher_accepts(
    compiler: GrammarCompiler, smollm2_tokenizer: TokenizerBundle
) -> None:
    choice = compiler.matcher(Constraint.choice(["red", "green"]))
    digits = compiler.matcher(Constraint.regex(r"[0-9]+"))
    vocab = 49152
    logits = torch.randn(3, vocab)
    before = logits.clone()
    MaskJob.start([(choice, ()), (None, ()), (digits, ())], vocab).apply(logits)
    assert torch.equal(logits[1], before[1])  # the unconstrained row is untouched
    for row, matcher in ((0, choice), (2, digits)):
        allowed = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert allowed
        assert all(matcher.inner.validate_tokens([t]) == 1 for t in allowed)
        kept = torch.isfinite(logits[row])
        assert torch.equal(logits[row][kept], before[row][kept])
    assert smollm2_tokenizer.encode("5")[0] in torch.isfinite(logits[2]).nonzero().flatten()
    assert not torch.isfinite(logits[2][smollm2_tokenizer.encode("a")[0]])


def test_draft_rows_get_the_masks_after_the_drafts_before_them(
    compiler: GrammarCompiler, smollm2_tokenizer: TokenizerBundle
) -> None:
    """Speculation: a request's row per draft is masked as if the drafts before it had been
    consumed, beside a plain constrained row; the matchers do not move."""
    schema = Constraint.json_schema(PERSON)
    text = smollm2_tokenizer.encode('{"name": "Bo", "age": 3}')
    drafting, plain = compiler.matcher(schema), compiler.matcher(Constraint.regex(r"[0-9]+"))
    assert drafting.valid_prefix(text[:4]) == 4
    assert drafting.valid_prefix([*text[:2], smollm2_tokenizer.encode("x")[0]]) == 2
    vocab = 49152
    logits = torch.randn(6, vocab)
    entries = [(plain, ()), (None, ()), (drafting, tuple(text[:3]))]
    job = MaskJob.start(entries, vocab)
    assert job.rows == [0, 2, 3, 4, 5]
    job.apply(logits)
    walker = compiler.matcher(schema)  # consumes the drafts by hand: the masks it gives
    for i in range(4):
        allowed = torch.isfinite(logits[2 + i])
        alone = torch.zeros(1, vocab)
        MaskJob.start([(walker, ())], vocab).apply(alone)
        assert torch.equal(allowed, torch.isfinite(alone[0])), i
        assert 0 < int(allowed.sum()) < vocab
        if i < 3:
            assert allowed[text[i]] and walker.consume(text[i])
    assert all(drafting.consume(t) for t in text) and drafting.accepting  # it had not moved
    assert torch.isfinite(logits[1]).all()


def test_unpack_reads_bits_low_first() -> None:
    bitmask = torch.tensor([[0b101, -(2**31)]], dtype=torch.int32)
    allowed = unpack(bitmask, 64).flatten().nonzero().flatten().tolist()
    assert allowed == [0, 2, 63]


def _lark_chain(links: int) -> str:
    return (
        "start: r0\n"
        + "\n".join(f'r{i}: "x" r{i + 1} | "y"' for i in range(links))
        + (f'\nr{links}: "z"')
    )


def _ref_chain(links: int) -> dict[str, object]:
    defs: dict[str, object] = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(links)
    }
    defs[f"d{links}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


@pytest.mark.parametrize(
    "constraint",
    [Constraint.grammar(_lark_chain(11_000)), Constraint.json_schema(_ref_chain(3_500))],
    ids=["lark-rule-chain", "schema-ref-chain"],
)
def test_a_chain_that_fits_the_size_bound_compiles_without_overflowing_the_stack(
    smollm2_vocabulary: Vocabulary, constraint: Constraint
) -> None:
    # llguidance recurses once per link: on a default 8 MiB thread stack either chain kills
    # the process (a segfault, not an exception), so reaching the assertion is the test.
    compiler = GrammarCompiler(smollm2_vocabulary, timeout=60.0)
    try:
        assert compiler.matcher(constraint) is not None
    finally:
        compiler.shutdown()


def test_a_gbnf_grammar_past_the_rule_bound_is_refused_before_compiling() -> None:
    from inferd.structured.constraint import MAX_GBNF_RULES

    def chain(rules: int) -> str:
        lines = [f'a{i} ::= "x" a{i + 1}' for i in range(rules - 2)]
        return "\n".join(["root ::= a0", *lines, f'a{rules - 2} ::= "z"'])

    assert Constraint.grammar(chain(MAX_GBNF_RULES)).kind is ConstraintKind.GRAMMAR
    with pytest.raises(ConstraintError, match=f"at most {MAX_GBNF_RULES}"):
        Constraint.grammar(chain(MAX_GBNF_RULES + 1))


def test_compile_threads_run_niced_below_the_engine(smollm2_vocabulary: Vocabulary) -> None:
    import os
    import threading

    from inferd.structured.compiler import COMPILE_NICE, COMPILE_THREADS

    # Thread objects, not idents: a thread that ends meanwhile (an earlier test's compiler
    # shutting down) may hand its ident to one of ours.
    before = set(threading.enumerate())
    compiler = GrammarCompiler(smollm2_vocabulary)
    try:
        mine = [t for t in threading.enumerate() if t not in before]
        assert len(mine) == COMPILE_THREADS  # all started up front, with the deep stack
        base = os.getpriority(os.PRIO_PROCESS, 0)
        for thread in mine:
            assert thread.native_id is not None
            assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == min(19, base + COMPILE_NICE)
    finally:
        compiler.shutdown()


def test_a_half_written_trigger_is_completed_only_into_a_valid_call(
    compiler: GrammarCompiler, smollm2_tokenizer: TokenizerBundle
) -> None:
    """tool_choice auto: after ``<tool_call`` a token such as ``>"`` would complete the trigger
    and open a call the grammar refuses (the request then failed with a 500); the mask allows
    only the completions the grammar takes, and leaves every other token free."""
    tool = ToolSpec("f", "", {"type": "object", "properties": {"a": {"type": "integer"}}})
    lazy = calls_constraint(Hermes(), [tool], parallel=True, lazy=True)
    vocab = 49152
    tokenizer = smollm2_tokenizer.tokenizer
    head = tokenizer.encode("Sure <tool_call", add_special_tokens=False).ids
    closers = [i for t, i in tokenizer.get_vocab().items() if t.startswith(">")]
    assert len(closers) > 1

    def walked() -> TokenMatcher:
        matcher = compiler.matcher(lazy)
        assert all(matcher.consume(t) for t in head)
        return matcher

    free = compiler.matcher(lazy)
    assert MaskJob.start([(free, ())], vocab).rows == []  # no trigger begun: the row is free
    logits = torch.zeros(1, vocab)
    MaskJob.start([(walked(), ())], vocab).apply(logits)
    allowed = torch.isfinite(logits[0])
    assert allowed[tokenizer.token_to_id(">")]
    assert allowed[tokenizer.token_to_id("s")]  # "<tool_calls" opens no call: free text
    refused = [t for t in closers if not allowed[t]]
    assert refused  # ">\"", ">.", ... would break the call
    for token in closers:
        assert walked().consume(token) == bool(allowed[token])


def test_one_grammar_serves_eager_and_lazy_use(compiler: GrammarCompiler) -> None:
    """required then auto with the same tools: one cached grammar, and the lazy matcher still
    knows which tokens complete its trigger."""
    tool = ToolSpec("f", "", {"type": "object"})
    eager = calls_constraint(Hermes(), [tool], parallel=False, lazy=False)
    lazy = calls_constraint(Hermes(), [tool], parallel=False, lazy=True)
    assert eager.digest == lazy.digest
    compiler.matcher(eager)
    matcher = compiler.matcher(lazy)
    assert all(matcher.consume(t) for t in compiler.vocabulary.get().tokenize_str("Hi <tool_call"))
    assert MaskJob.start([(matcher, ())], 49152).rows == [0]  # the trigger is half written: masked


def _row_masks(entries: list[tuple[TokenMatcher | None, tuple[int, ...]]]) -> torch.Tensor:
    """The allowed tokens of each row a step with ``entries`` has (all True: a free row)."""
    rows = sum(1 + len(draft) for _, draft in entries)
    logits = torch.zeros(rows, 49152)
    MaskJob.start(entries, 49152).apply(logits)
    return torch.isfinite(logits)


def test_a_waiting_lazy_matcher_follows_drafts_up_to_its_trigger(
    compiler: GrammarCompiler, smollm2_tokenizer: TokenizerBundle
) -> None:
    """tool_choice auto with drafts: a draft is cut before the token that would complete the
    trigger, and each row after a draft gets the mask the matcher gives once the drafts before
    it are consumed one by one (free, or masked where the trigger is half written); the matcher
    itself does not move."""
    tool = ToolSpec("f", "", {"type": "object", "properties": {"a": {"type": "integer"}}})
    lazy = calls_constraint(Hermes(), [tool], parallel=True, lazy=True)
    text = smollm2_tokenizer.encode('Sure, <tool_call>{"name": "f"')
    walker = compiler.matcher(lazy)
    completes = next(i for i, t in enumerate(text) if walker.consume(t) and walker.inner)
    matcher = compiler.matcher(lazy)
    assert completes > 2 and matcher.valid_prefix(text) == completes
    draft = tuple(text[:completes])
    got = _row_masks([(None, (text[0],)), (matcher, draft)])[2:]
    walker = compiler.matcher(lazy)
    for i in range(len(draft) + 1):
        assert torch.equal(got[i], _row_masks([(walker, ())])[0]), i
        if i < len(draft):
            assert got[i][draft[i]] and walker.consume(draft[i])
    assert got[0].all() and not got[-1].all()  # free at first; half a trigger: masked
    assert got[-1][text[completes]] and walker.consume(text[completes])  # a call opens
    assert matcher.mask_source() is None and matcher.inner is None  # it had not moved


def test_draft_guides_allow_what_the_rows_would(
    compiler: GrammarCompiler, smollm2_tokenizer: TokenizerBundle
) -> None:
    """A draft model's guide: a grammar's allows what its row's mask allows, step by step; a
    waiting lazy matcher's allows every token but those that would complete the trigger."""
    schema = Constraint.json_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    text = smollm2_tokenizer.encode('{"a": 12}')
    matcher, walker = compiler.matcher(schema), compiler.matcher(schema)
    guide = matcher.draft_guide()
    assert guide is not None
    for token in text:
        allowed = guide.allowed(49152)
        assert allowed is not None and torch.equal(allowed, _row_masks([(walker, ())])[0])
        guide.take(token)
        assert walker.consume(token)
    assert matcher.valid_prefix(text) == len(text)  # the guide moved a copy
    ended = guide.allowed(49152)
    assert ended is not None and not ended.any()  # complete: nothing more to draft

    tool = ToolSpec("f", "", {"type": "object"})
    lazy = compiler.matcher(calls_constraint(Hermes(), [tool], parallel=False, lazy=True))
    waiting = lazy.draft_guide()
    assert waiting is not None
    for token in smollm2_tokenizer.encode("Hi <tool_call"):
        waiting.take(token)
    allowed = waiting.allowed(49152)
    closer = smollm2_tokenizer.tokenizer.token_to_id(">")
    assert allowed is not None and not allowed[closer] and allowed.sum() > 40_000
    assert lazy.valid_prefix(smollm2_tokenizer.encode("Hi <tool_call>")) < len(
        smollm2_tokenizer.encode("Hi <tool_call>")
    )
