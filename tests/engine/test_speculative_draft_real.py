"""Draft-model and self-speculation on the real default model: the same greedy text as without
speculation (SmolLM2 drafting for itself accepts nearly everything; its first half of layers
much less, drafting from the served model's own KV), stop strings and max_tokens cut at the
same token, the same bits under ``deterministic=True``, every KV block and draft cache freed
after, and a draft model with another tokenizer refused at startup. Constrained requests draft
under their constraint."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from inferd import LLM
from inferd.engine.draft_model import DraftModel
from inferd.engine.sampling import SamplingParams
from inferd.serving.loading import ModelLoadError
from inferd.structured.constraint import Constraint
from tests.engine.bits import run_bits
from tests.engine.test_speculative_constrained_real import (
    JSON_COPY,
    SCHEMA,
    SENTENCE,
    TEXT_COPY,
    _run,
    _seeded,
)
from tests.engine.test_speculative_real import COPY, FREE
from tests.models.tiny import save_tiny


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1, ignore_eos=True)


def _drafter(llm: LLM) -> DraftModel:
    speculator = llm.engine._core.scheduler.speculator
    assert speculator is not None and speculator.drafter is not None
    return speculator.drafter


@pytest.fixture(scope="module")
def engines(smollm2_gguf: Path) -> Iterator[dict[str, LLM]]:
    model = str(smollm2_gguf)
    with (
        LLM(model, speculative="off") as off,
        LLM(model, speculative="draft", draft_model=model) as draft,
        LLM(model, speculative="self") as self_,
    ):
        yield {"off": off, "draft": draft, "self": self_}


def test_greedy_text_is_unchanged_by_a_draft_model(engines: dict[str, LLM]) -> None:
    off = engines["off"]
    prompts = [off.model.chat_prompt(COPY).ids, off.model.chat_prompt(FREE).ids]
    params = [_greedy(40), _greedy(32)]
    plain = run_bits(off, prompts, params)
    for mode in ("draft", "self"):
        llm = engines[mode]
        before = llm.engine.stats()
        got = [run_bits(llm, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
        after = llm.engine.stats()
        drafted = after.speculative_drafted - before.speculative_drafted
        accepted = after.speculative_accepted - before.speculative_accepted
        assert drafted > 0, mode
        if mode == "draft":  # the model drafting for itself: (nearly) all accepted
            assert accepted >= 0.9 * drafted
            assert after.steps - before.steps < sum(p.max_tokens for p in params) - accepted + 4
        for g, want in zip(got, plain, strict=True):
            assert g[0] == want[0], mode  # the same tokens
            assert max(abs(a - b) for a, b in zip(g[1], want[1], strict=True)) < 0.05
        assert after.kv_blocks_used == 0
        assert _drafter(llm).caches == {}  # each finished request's draft KV is dropped


def test_stop_strings_and_max_tokens_cut_at_the_same_token(engines: dict[str, LLM]) -> None:
    off, draft = engines["off"], engines["draft"]
    prompt = off.model.chat_prompt(COPY).ids
    stop = SamplingParams(max_tokens=200, temperature=0, stop=("the names",), ignore_eos=True)
    cases = {"stop": stop, "length": _greedy(37)}  # 37: not a whole number of verify steps
    for reason, params in cases.items():
        fast = draft.generate([prompt], [params], use_tqdm=False)[0].outputs[0]
        plain = off.generate([prompt], [params], use_tqdm=False)[0].outputs[0]
        assert fast.finish_reason == plain.finish_reason == reason
        assert (fast.text, fast.token_ids) == (plain.text, plain.token_ids)
    assert len(fast.token_ids) == 37


def test_sampled_requests_run_and_free_everything(engines: dict[str, LLM]) -> None:
    draft = engines["draft"]
    prompt = draft.model.chat_prompt(FREE).ids
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, ignore_eos=True)
    before = draft.engine.stats()
    outs = draft.generate([prompt, prompt], [params, params], use_tqdm=False)
    after = draft.engine.stats()
    assert [len(o.outputs[0].token_ids) for o in outs] == [24, 24]
    # q is p here (the same model): nearly every draw is accepted
    drafted = after.speculative_drafted - before.speculative_drafted
    assert after.speculative_accepted - before.speculative_accepted >= 0.8 * drafted > 0
    assert after.kv_blocks_used == 0 and _drafter(draft).caches == {}


def test_constrained_drafts_follow_the_constraint(engines: dict[str, LLM]) -> None:
    """Under a JSON schema or a regex the draft model drafts from its logits masked by the
    constraint (a refused draft is never drawn, so none is cut after): the same greedy output
    as without speculation; the model drafting for itself has nearly every draft stand, a full
    draft each step. A sampled constrained request validates, its masked draws accepted."""
    off = engines["off"]
    json_prompt, text_prompt = (
        off.model.chat_prompt(JSON_COPY).ids,
        off.model.chat_prompt(TEXT_COPY).ids,
    )
    prompts = [json_prompt, text_prompt]
    params = [
        SamplingParams(max_tokens=80, temperature=0, constraint=Constraint.json_schema(SCHEMA)),
        SamplingParams(max_tokens=60, temperature=0, constraint=Constraint.regex(SENTENCE)),
    ]
    plain = [_run(off, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
    for mode in ("draft", "self"):
        llm = engines[mode]
        before = llm.engine.stats()
        got = [_run(llm, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
        after = llm.engine.stats()
        assert got == plain, mode
        drafted = after.speculative_drafted - before.speculative_drafted
        accepted = after.speculative_accepted - before.speculative_accepted
        assert accepted > 0, mode
        if mode == "draft":
            tokens = sum(len(g[0]) for g in got)
            assert accepted >= 0.9 * drafted
            assert drafted >= 0.6 * tokens  # ~3 drafts for every 4 tokens: none cut
    draft = engines["draft"]
    before = draft.engine.stats()
    sampled = [_seeded(s, 80, Constraint.json_schema(SCHEMA)) for s in range(2)]
    # unseeded, at the seeded ones' 0.5: at 0.8 the model may wander off the copy and run to
    # max_tokens inside a string (seen once in a full run)
    sampled.append(replace(sampled[0], seed=None))
    for _, text, reason in _run(draft, [json_prompt] * 3, sampled):
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    after = draft.engine.stats()
    drafted = after.speculative_drafted - before.speculative_drafted
    assert after.speculative_accepted - before.speculative_accepted >= 0.8 * drafted > 0
    assert after.kv_blocks_used == 0 and _drafter(draft).caches == {}


def test_self_drafts_from_the_served_models_kv(smollm2_gguf: Path) -> None:
    """Self-drafting keeps no KV of its own: its layers read the served model's paged cache.
    Mid-request, its drafts are those of a draft model with the same layers and its own cache,
    which catches up over the whole sequence first (float32: the two KV agree to rounding)."""
    with LLM(str(smollm2_gguf), speculative="self", dtype="f32") as llm:
        engine, drafter = llm.engine, _drafter(llm)
        assert drafter.shared is not None
        engine.add_request("r", llm.model.chat_prompt(FREE).ids, _greedy(48))
        scheduler = engine._core.scheduler
        while not scheduler.running or len(scheduler.running[0].output_token_ids) < 20:
            engine.step()
        request = scheduler.running[0]
        own = DraftModel(drafter.model, drafter.dtype, drafter.num_layers)
        for k in (1, 5):
            assert drafter.propose(request, k).tokens == own.propose(request, k).tokens
        assert drafter.caches == {}
        while engine.has_unfinished():
            engine.step()
        assert engine.stats().kv_blocks_used == 0


def test_deterministic_bits_are_unchanged(smollm2_gguf: Path) -> None:
    model = str(smollm2_gguf)
    options: dict[str, Any] = {"deterministic": True}
    params = [_greedy(32), _greedy(24)]
    results = {}
    modes: tuple[tuple[str, dict[str, Any]], ...] = (
        ("off", {}),
        ("draft", {"draft_model": model}),
        ("self", {}),
    )
    for mode, extra in modes:
        with LLM(model, speculative=mode, **options, **extra) as llm:
            prompts = [llm.model.chat_prompt(m).ids for m in (COPY, FREE)]
            results[mode] = run_bits(llm, prompts, params)  # both in one batch
            assert llm.engine.stats().kv_blocks_used == 0
            if mode != "off":
                assert llm.engine.stats().speculative_drafted > 0
    assert results["draft"] == results["off"]
    assert results["self"] == results["off"]


def test_a_draft_model_with_another_tokenizer_is_refused(
    smollm2_gguf: Path, tmp_path: Path
) -> None:
    save_tiny("llama", tmp_path)  # a byte-level vocabulary
    # Refused before any request (LLM wraps the engine's errors in ModelLoadError)
    with pytest.raises(ModelLoadError, match="a draft model needs the same tokenizer"):
        LLM(str(smollm2_gguf), speculative="draft", draft_model=str(tmp_path))
    with pytest.raises((ValueError, ModelLoadError), match="draft_model"):
        LLM(str(smollm2_gguf), speculative="draft")
