"""The engine on the tiny random Gemma 3 vision checkpoint: greedy output equal to transformers'
generate with images, whatever the step budget (chunks never end inside an image, even when an
image's tokens outnumber the budget) and in deterministic mode; a chat prompt through the
served model's template; an image whose placeholder tokens are not consecutive refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.llm_engine import AdmissionError, LLMEngine
from inferd.engine.request import MediaInput
from inferd.engine.sampling import SamplingParams
from inferd.serving.multimodal import image_digest
from inferd.serving.served import ServedModel, load_model
from tests.models.test_idefics3_processor import generated
from tests.models.tiny_gemma3v import MM_TOKENS

NEW = 8

CASES = {
    "one image": (
        "<start_of_turn>user\nHi <start_of_image>What is in this picture?<end_of_turn>\n",
        [generated(70, 50, seed=1)],
    ),
    "two images": (
        "Compare <start_of_image> with the next one, the lighthouse keeper:<start_of_image> "
        "please: which fox is quick?",
        [generated(300, 200, seed=2), generated(9, 40, seed=3)],
    ),
    "text only": ("The quick brown fox jumps over the lazy dog.", []),
}


def served_with(directory: Path, **overrides: Any) -> ServedModel:
    settings: dict[str, Any] = {"dtype": "f32", "kv_cache_tokens": 2048, "max_model_len": 512}
    cfg = EngineConfig(**(settings | overrides))
    return load_model(directory, cfg, progress=False, loop=CallerLoop())


@pytest.fixture(scope="module", params=[8, 24, "deterministic"])
def served(request: pytest.FixtureRequest, tiny_gemma3v: Any) -> Iterator[ServedModel]:
    """Budgets of 8 (under an image's 16 soft tokens) and 24 tokens a step, and 24 in
    deterministic mode (each prompt row a one-query decode, except inside images)."""
    if request.param == "deterministic":
        model = served_with(tiny_gemma3v[0], max_num_batched_tokens=24, deterministic=True)
    else:
        model = served_with(tiny_gemma3v[0], max_num_batched_tokens=request.param)
    yield model
    model.shutdown()


def run(engine: LLMEngine, rid: str, ids: list[int], media: list[MediaInput]) -> list[int]:
    engine.add_request(rid, ids, SamplingParams(max_tokens=NEW, temperature=0), media=media)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
    return tokens


_REFERENCES: dict[str, list[int]] = {}  # per case: the same for every engine setting


def reference(processor: Any, hf: Any, case: str) -> list[int]:
    if case not in _REFERENCES:
        _REFERENCES[case] = _generate(processor, hf, *CASES[case])
    return _REFERENCES[case]


def _generate(processor: Any, hf: Any, text: str, images: list[Image.Image]) -> list[int]:
    inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_transformers_generate(
    served: ServedModel, tiny_gemma3v: Any, case: str
) -> None:
    _, hf, processor = tiny_gemma3v
    text, images = CASES[case]
    ids, media = served.prompt(text, [(i, image_digest(i)) for i in images])
    assert ids == processor(text=[text], images=[images] if images else None)["input_ids"][0]
    got = run(served.engine.engine, f"greedy-{case}", ids, media)
    assert got == reference(processor, hf, case)


def test_an_image_whose_tokens_are_not_consecutive_is_refused(tiny_gemma3v: Any) -> None:
    served = served_with(tiny_gemma3v[0])
    try:
        text, images = CASES["one image"]
        ids, media = served.prompt(text, [(images[0], "x")])
        m = media[0]
        split = list(m.positions)
        moved = split[-1] + 2  # a placeholder token past the end of the image
        ids[moved] = ids[split[-1]]
        bad = MediaInput(m.digest, (*split[1:], moved), m.pixel_values, m.expand)
        with pytest.raises(AdmissionError, match="consecutive"):
            served.engine.engine.add_request("bad", ids, SamplingParams(max_tokens=1), media=[bad])
        assert len(m.positions) == MM_TOKENS
    finally:
        served.shutdown()


def test_deterministic_prompt_logprobs_do_not_depend_on_the_budget(tiny_gemma3v: Any) -> None:
    """In deterministic mode (bf16) each text row is a one-query decode and each image a
    prefill of its own, whose shapes do not depend on the chunking: the prompt's logprobs
    are the same bits at 8 tokens a step (the images cut the chunks) and at 512 (one chunk)."""
    text, images = CASES["two images"]
    runs = []
    for budget in (8, 512):
        served = served_with(
            tiny_gemma3v[0], max_num_batched_tokens=budget, deterministic=True, dtype="bf16"
        )
        try:
            ids, media = served.prompt(text, [(i, image_digest(i)) for i in images])
            engine = served.engine.engine
            params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
            engine.add_request("det", ids, params, media=media)
            outputs = []
            while engine.has_unfinished():
                outputs += engine.step()
            runs.append([o.prompt_logprobs for o in outputs if o.prompt_logprobs])
        finally:
            served.shutdown()
    assert runs[0] and runs[0] == runs[1]
