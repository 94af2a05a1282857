"""The engine on the tiny random Idefics3 (SmolVLM) checkpoint: greedy output equal to
transformers' generate with images, chunked prefill through an image, the encoder cache (a
repeated image is encoded once) and the prefix cache keyed by image digests."""

from __future__ import annotations

import hashlib
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
from inferd.models.idefics3 import Idefics3ForCausalLM
from inferd.serving.multimodal import ImagePromptError
from inferd.serving.served import ServedModel, load_model
from tests.models.test_idefics3_processor import generated

CHUNK = 32  # tokens per step: an image of 10 tiles (40 placeholders) spans several steps
NEW = 8


@pytest.fixture(scope="module")
def served(tiny_idefics3: tuple[Path, Any, Any]) -> Iterator[ServedModel]:
    cfg = EngineConfig(
        dtype="f32", max_num_batched_tokens=CHUNK, kv_cache_tokens=2048, max_model_len=512
    )
    model = load_model(tiny_idefics3[0], cfg, progress=False, loop=CallerLoop())
    yield model
    model.shutdown()


def digest(image: Image.Image) -> str:
    return hashlib.sha256(image.tobytes()).hexdigest()


def run(engine: LLMEngine, rid: str, ids: list[int], media: list[MediaInput]) -> list[int]:
    engine.add_request(rid, ids, SamplingParams(max_tokens=NEW, temperature=0), media=media)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
    return tokens


def reference(hf_processor: Any, hf: Any, text: str, images: list[Image.Image]) -> list[int]:
    inputs = hf_processor(text=[text], images=[images] if images else None, return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def encoder(served: ServedModel) -> Idefics3ForCausalLM:
    model = served.engine.engine.model
    assert isinstance(model, Idefics3ForCausalLM)
    return model


CAT = generated(70, 50, seed=1)
DOG = generated(300, 200, seed=2)
SMALL = generated(9, 40, seed=3)


@pytest.mark.parametrize(
    ("text", "images"),
    [
        ("<|im_start|>user\n<image>What is in this picture?<|im_end|>\n", [CAT]),
        ("Compare <image> with<image> please: which fox is quick?", [DOG, SMALL]),
        ("The quick brown fox jumps over the lazy dog.", []),
    ],
    ids=["one image", "two images", "text only"],
)
def test_greedy_equals_transformers_generate(
    served: ServedModel, tiny_idefics3: Any, text: str, images: list[Image.Image]
) -> None:
    _, hf, processor = tiny_idefics3
    ids, media = served.prompt(text, [(i, digest(i)) for i in images])
    assert ids == processor(text=[text], images=[images] if images else None)["input_ids"][0]
    assert len(ids) > CHUNK or not images  # the prefill runs in chunks that cut an image
    assert run(served.engine.engine, f"greedy-{len(ids)}", ids, media) == reference(
        processor, hf, text, images
    )


def test_a_repeated_image_is_encoded_once(served: ServedModel) -> None:
    model, engine = encoder(served), served.engine.engine
    image = generated(64, 48, seed=11)
    before, stats = model.encoder_calls, engine.stats()
    for n, question in enumerate(["<image>Where?", "<image>And now, when?"]):
        ids, media = served.prompt(question, [(image, digest(image))])
        run(engine, f"repeat-{n}", ids, media)
    assert model.encoder_calls - before == 1  # over several chunks and two requests
    after = engine.stats()
    assert after.images_encoded - stats.images_encoded == 1
    # the first request's second chunk (the second finds the image's blocks in the prefix cache)
    assert after.encoder_cache_hits - stats.encoder_cache_hits >= 1
    other = generated(64, 48, seed=12)
    ids, media = served.prompt("<image>Where?", [(other, digest(other))])
    run(engine, "repeat-other", ids, media)
    assert model.encoder_calls - before == 2


def test_prefix_cache_keys_blocks_by_image(served: ServedModel, tiny_idefics3: Any) -> None:
    _, hf, processor = tiny_idefics3
    engine = served.engine.engine
    text = "<image>Describe the picture in one word, then another one."
    first, second = generated(50, 90, seed=21), generated(50, 90, seed=22)

    def ask(rid: str, image: Image.Image) -> tuple[list[int], int]:
        hits = engine.stats().prefix_cache_hits
        ids, media = served.prompt(text, [(image, digest(image))])
        tokens = run(engine, rid, ids, media)
        return tokens, engine.stats().prefix_cache_hits - hits

    a, hits_a = ask("prefix-a", first)
    b, hits_b = ask("prefix-b", second)  # the same tokens, another image
    c, hits_c = ask("prefix-c", first)  # the same tokens and image
    assert hits_a == hits_b == 0
    assert hits_c > 0
    assert b == reference(processor, hf, text, [second])
    assert a == c == reference(processor, hf, text, [first])


def test_images_must_sit_on_their_placeholders(served: ServedModel) -> None:
    engine = served.engine.engine
    ids, media = served.prompt("<image>Hi", [(CAT, digest(CAT))])
    shifted = MediaInput(
        media[0].digest, tuple(p + 1 for p in media[0].positions), media[0].pixel_values
    )
    with pytest.raises(AdmissionError) as refused:
        engine.add_request("bad", ids, SamplingParams(max_tokens=1), media=[shifted])
    assert (refused.value.param, refused.value.code) == ("messages", "invalid_media")
    one_tile_less = MediaInput(media[0].digest, media[0].positions, media[0].pixel_values[1:])
    with pytest.raises(AdmissionError, match="placeholder tokens, not"):
        engine.add_request("bad", ids, SamplingParams(max_tokens=1), media=[one_tile_less])
    with pytest.raises(ImagePromptError):
        served.prompt("<image> and <image>", [(CAT, digest(CAT))])
    assert served.modalities["input"] == ["text", "image"]


def test_chat_with_image_parts_matches_transformers(
    served: ServedModel, tiny_idefics3: Any
) -> None:
    _, hf, processor = tiny_idefics3
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}
    ]
    ids, media = served.chat_prompt(messages, [(DOG, digest(DOG))])
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == processor(text=[text], images=[[DOG]])["input_ids"][0]
    assert run(served.engine.engine, "chat", ids, media) == reference(processor, hf, text, [DOG])


def test_an_image_marker_typed_by_the_user_stays_text(served: ServedModel) -> None:
    typed = {"type": "text", "text": "Is <image> a tag?"}
    messages = [{"role": "user", "content": [{"type": "image"}, typed]}]
    ids, media = served.chat_prompt(messages, [(CAT, digest(CAT))])
    assert len(media) == 1
    placeholders = sum(1 for t in ids if t == encoder(served).image_token_id)
    assert placeholders == len(media[0].positions)  # the typed one is plain text
    with pytest.raises(ImagePromptError):  # it is no image slot either
        served.chat_prompt(messages, [(CAT, digest(CAT)), (DOG, digest(DOG))])


def test_images_of_one_step_are_encoded_in_one_batch(
    tiny_idefics3: tuple[Path, Any, Any],
) -> None:
    _, hf, processor = tiny_idefics3
    cfg = EngineConfig(dtype="f32", max_num_batched_tokens=512, kv_cache_tokens=2048)
    served = load_model(tiny_idefics3[0], cfg, progress=False, loop=CallerLoop())
    try:
        engine, model = served.engine.engine, encoder(served)
        jobs = [("<image>Who?", DOG), ("<image>Where?", SMALL), ("<image>When?", DOG)]
        for n, (text, image) in enumerate(jobs):
            ids, media = served.prompt(text, [(image, digest(image))])
            engine.add_request(
                str(n), ids, SamplingParams(max_tokens=NEW, temperature=0), media=media
            )
        tokens: dict[str, list[int]] = {str(n): [] for n in range(len(jobs))}
        first = engine.step()  # every prompt in one step: DOG and SMALL, DOG once
        assert len(first) == len(jobs) and model.encoder_calls == 1
        for out in first:
            tokens[out.request_id] += out.token_ids
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
        assert model.encoder_calls == 1
        for n, (text, image) in enumerate(jobs):
            assert tokens[str(n)] == reference(processor, hf, text, [image])
    finally:
        served.shutdown()


def test_a_text_model_refuses_images(served_f32: ServedModel) -> None:
    ids = served_f32.chat_prompt([{"role": "user", "content": "Hi"}]).ids
    media = [MediaInput("d", (0,), torch.zeros(1, 3, 32, 32))]
    with pytest.raises(AdmissionError, match="take no images"):
        served_f32.engine.engine.add_request("img", ids, SamplingParams(max_tokens=1), media=media)
    with pytest.raises(ImagePromptError):
        served_f32.prompt("<image>Hi", [(CAT, digest(CAT))])
    assert served_f32.modalities["input"] == ["text"]


def test_plain_text_chat_reaches_a_parts_only_template(
    served: ServedModel, tiny_idefics3: Any
) -> None:
    processor = tiny_idefics3[2]
    ids = served.chat_prompt([{"role": "user", "content": "The quick brown fox"}]).ids
    parts = [{"role": "user", "content": [{"type": "text", "text": "The quick brown fox"}]}]
    text = processor.apply_chat_template(parts, add_generation_prompt=True)
    assert ids == processor.tokenizer(text)["input_ids"]
    assert "quick brown fox" in served.tokenizer.tokenizer.decode(ids)


def test_the_python_api_chats_about_images(tiny_idefics3: tuple[Path, Any, Any]) -> None:
    from inferd import LLM

    _, hf, processor = tiny_idefics3
    question = {"type": "text", "text": "Which is larger?"}
    with LLM(tiny_idefics3[0], dtype="f32", kv_cache_tokens=2048) as llm:
        conversations = [
            [{"role": "user", "content": [{"type": "image", "image": img}, question]}]
            for img in (DOG, SMALL)
        ]
        outputs = llm.chat(conversations, SamplingParams(max_tokens=NEW, temperature=0))
    template = [{"role": "user", "content": [{"type": "image"}, question]}]
    text = processor.apply_chat_template(template, add_generation_prompt=True)
    for out, img in zip(outputs, (DOG, SMALL), strict=True):
        assert list(out.outputs[0].token_ids) == reference(processor, hf, text, [img])
