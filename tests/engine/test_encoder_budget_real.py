"""The encoder budget on the tiny random Idefics3 (SmolVLM) checkpoint: a request with more image
rows than one step's encoder budget spreads its encoding over several steps, each step within
the budget (or one image alone when it is larger than the budget), with the same greedy output
as without the budget and as transformers' generate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.request import MediaInput
from inferd.engine.sampling import SamplingParams
from inferd.models.idefics3 import Idefics3ForCausalLM
from inferd.serving.served import ServedModel, load_model
from tests.engine.test_multimodal_real import NEW, digest, reference
from tests.models.test_idefics3_processor import generated

TEXT = "<image>One,<image> two,<image> three<image> and four: which is brightest?"
IMAGES = [generated(40 + 30 * n, 50, seed=40 + n) for n in range(4)]


@dataclass(frozen=True, slots=True)
class Run:
    tokens: list[int]
    encoded: list[list[MediaInput]]  # per step with encoder work: the images it encoded
    images_encoded: int  # encoder runs, an image each (misses of the encoder cache)


def serve(path: Path, encoder_tokens: int | None) -> ServedModel:
    cfg = EngineConfig(
        dtype="f32",
        max_num_batched_tokens=512,  # the whole prompt fits one step's token budget
        kv_cache_tokens=2048,
        max_model_len=512,
        max_encoder_tokens=encoder_tokens,
    )
    return load_model(path, cfg, progress=False, loop=CallerLoop())


def run(path: Path, encoder_tokens: int | None) -> Run:
    """The four-image request alone on a fresh engine, watched step by step."""
    served = serve(path, encoder_tokens)
    try:
        engine = served.engine.engine
        assert isinstance(engine.model, Idefics3ForCausalLM)
        ids, media = served.prompt(TEXT, [(i, digest(i)) for i in IMAGES])
        params = SamplingParams(max_tokens=NEW, temperature=0)
        engine.add_request("four", ids, params, media=media)
        tokens: list[int] = []
        encoded: list[list[MediaInput]] = []
        while engine.has_unfinished():
            before = {m.digest for m in media if engine.encoder_cached(m.digest)}
            for out in engine.step():
                tokens += out.token_ids
            new = [m for m in media if engine.encoder_cached(m.digest) and m.digest not in before]
            if new:
                encoded.append(new)
        return Run(tokens, encoded, engine.stats().images_encoded)
    finally:
        served.shutdown()


def rows(media: list[MediaInput]) -> int:
    return sum(len(m.positions) for m in media)


@pytest.fixture(scope="module")
def unbounded(tiny_idefics3: tuple[Path, Any, Any]) -> Run:
    return run(tiny_idefics3[0], None)


def test_without_a_tight_budget_one_step_encodes_every_image(
    unbounded: Run, tiny_idefics3: tuple[Path, Any, Any]
) -> None:
    _, hf, processor = tiny_idefics3
    assert len(unbounded.encoded) == 1 and len(unbounded.encoded[0]) == len(IMAGES)
    assert unbounded.images_encoded == len(IMAGES)
    assert unbounded.tokens == reference(processor, hf, TEXT, IMAGES)


def test_a_tight_budget_spreads_encoding_over_steps(
    unbounded: Run, tiny_idefics3: tuple[Path, Any, Any]
) -> None:
    sizes = [len(m.positions) for m in unbounded.encoded[0]]
    budget = max(sizes[0] + sizes[1], max(sizes))  # room for two images, not four
    assert budget < sum(sizes)
    tight = run(tiny_idefics3[0], budget)
    assert len(tight.encoded) >= 2  # spread over steps ...
    assert all(rows(step) <= budget for step in tight.encoded)  # ... each within the budget
    assert sorted(m.digest for step in tight.encoded for m in step) == sorted(
        digest(i) for i in IMAGES
    )
    assert tight.images_encoded == len(IMAGES)  # each image encoded once
    assert tight.tokens == unbounded.tokens


def test_images_larger_than_the_budget_run_one_per_step(
    unbounded: Run, tiny_idefics3: tuple[Path, Any, Any]
) -> None:
    smallest = min(len(m.positions) for m in unbounded.encoded[0])
    alone = run(tiny_idefics3[0], smallest - 1)  # no image fits: each runs alone, no deadlock
    assert [len(step) for step in alone.encoded] == [1] * len(IMAGES)
    assert alone.images_encoded == len(IMAGES)
    assert alone.tokens == unbounded.tokens
