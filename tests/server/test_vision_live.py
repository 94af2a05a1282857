"""`inferd serve` on a Hugging Face Idefics3 (SmolVLM) directory: it loads, /v1/models says it
takes images, text chat runs on its decoder, and images sent over the OpenAI and Anthropic APIs
(official SDKs, strict) reach the model: greedy output equal to transformers' generate on the
same image, usage counting the image's tokens, the encoder cache shared by requests, hostile
images refused by name, file:// only under --allowed-media-root."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import torch
from PIL import Image

from tests.models.test_idefics3_processor import generated
from tests.server.live import LiveServer, live_server

NEW = 8  # tokens generated per parity check


@pytest.fixture(scope="module")
def media_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the allowed media root, a directory beside it), each holding a PNG."""
    base = tmp_path_factory.mktemp("vision-media")
    inside, outside = base / "allowed", base / "elsewhere"
    for directory, seed in ((inside, 31), (outside, 32)):
        directory.mkdir()
        (directory / "picture.png").write_bytes(png_bytes(generated(60, 80, seed=seed)))
    return inside, outside


@pytest.fixture(scope="module")
def vision_server(
    tiny_idefics3: tuple[Path, Any, Any],
    media_dirs: tuple[Path, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("vision-serve") / "serve.log"
    args = ["-m", str(tiny_idefics3[0]), "--dtype", "f32", "--encoder-cache-mb", "16"]
    args += ["--max-seq-len", "256"]  # eight images of 3x3 tiles (320 tokens) overflow it
    args += ["--allowed-media-root", str(media_dirs[0])]
    with live_server(args, log) as live:
        yield live


@pytest.fixture(scope="module")
def model_id(vision_server: LiveServer) -> str:
    return str(httpx.get(vision_server.api + "/models", timeout=10).json()["data"][0]["id"])


@pytest.fixture(scope="module")
def oai(vision_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=vision_server.api,
        api_key="unused",
        max_retries=0,
        _strict_response_validation=True,
    ) as client:
        yield client


@pytest.fixture(scope="module")
def claude(vision_server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=vision_server.url,
        api_key="unused",
        max_retries=0,
        _strict_response_validation=True,
    ) as client:
        yield client


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_turn(url: str, question: str = "What is in this picture?") -> list[Any]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    return [{"role": "user", "content": parts}]


def reference(tiny_idefics3: tuple[Path, Any, Any], image: Image.Image, question: str) -> Any:
    """transformers' prompt ids and greedy reply for one image and a question after it."""
    _, hf, processor = tiny_idefics3
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[[image]], return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    return (
        inputs["input_ids"].shape[1],
        new,
        processor.tokenizer.decode(new, skip_special_tokens=True),
    )


def test_models_lists_image_input(vision_server: LiveServer) -> None:
    cards = httpx.get(vision_server.api + "/models", timeout=10).json()["data"]
    assert len(cards) == 1
    assert cards[0]["modalities"]["input"] == ["text", "image"]
    assert cards[0]["modalities"]["output"] == ["text"]


def test_text_chat_runs_on_the_vision_model(
    vision_server: LiveServer, tiny_idefics3: tuple[Path, Any, Any]
) -> None:
    body = {
        "model": httpx.get(vision_server.api + "/models", timeout=10).json()["data"][0]["id"],
        "messages": [{"role": "user", "content": "The quick brown fox"}],
        "max_tokens": 5,
        "temperature": 0,
    }
    reply = httpx.post(vision_server.api + "/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["completion_tokens"] == 5
    processor = tiny_idefics3[2]  # the text reached the template (it iterates content parts)
    parts = [{"role": "user", "content": [{"type": "text", "text": "The quick brown fox"}]}]
    text = processor.apply_chat_template(parts, add_generation_prompt=True)
    assert usage["prompt_tokens"] == len(processor.tokenizer(text)["input_ids"])


QUESTION = "What is in this picture?"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_an_image_reaches_the_model_as_transformers_sees_it(
    oai: openai.OpenAI, model_id: str, tiny_idefics3: tuple[Path, Any, Any], stream: bool
) -> None:
    image = generated(70, 50, seed=1)
    prompt_tokens, new_ids, text = reference(tiny_idefics3, image, QUESTION)
    ask: dict[str, Any] = {
        "model": model_id,
        "messages": image_turn(data_url(png_bytes(image)), QUESTION),
        "max_tokens": NEW,
        "temperature": 0,
    }
    if stream:
        chunks = list(
            oai.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
        )
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        reply = oai.chat.completions.create(**ask)
        answer, usage = reply.choices[0].message.content or "", reply.usage
    assert usage is not None
    assert usage.prompt_tokens == prompt_tokens  # the image's tile tokens counted
    assert usage.completion_tokens == len(new_ids)
    assert answer == text


def test_n_choices_share_the_image(oai: openai.OpenAI, model_id: str) -> None:
    image = generated(40, 90, seed=5)
    reply = oai.chat.completions.create(
        model=model_id,
        messages=image_turn(data_url(png_bytes(image))),
        max_tokens=4,
        temperature=0,
        n=2,
    )
    first, second = (c.message.content for c in reply.choices)
    assert first == second  # greedy: both choices saw the same image
    assert reply.usage is not None and reply.usage.completion_tokens == 8


def test_image_size_sets_the_tiles_and_a_repeat_hits_the_encoder_cache(
    vision_server: LiveServer, oai: openai.OpenAI, model_id: str
) -> None:
    def prompt_tokens(image: Image.Image, lead: str) -> int:
        parts: Any = [
            {"type": "text", "text": lead},  # before the image: the prefix cache cannot serve it
            {"type": "image_url", "image_url": {"url": data_url(png_bytes(image))}},
        ]
        reply = oai.chat.completions.create(
            model=model_id,
            messages=[{"role": "user", "content": parts}],
            max_tokens=1,
            temperature=0,
        )
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    small, big = generated(20, 30, seed=41), generated(300, 200, seed=42)
    assert prompt_tokens(big, "Look:") > prompt_tokens(small, "Look:")  # more tiles
    hits = vision_server.metric("inferd_encoder_cache_hits_total")
    encoded = vision_server.metric("inferd_images_encoded_total")
    assert prompt_tokens(big, "And now, once more:") > 0
    assert vision_server.metric("inferd_encoder_cache_hits_total") == hits + 1
    assert vision_server.metric("inferd_images_encoded_total") == encoded


def test_hostile_images_are_refused_by_name(
    vision_server: LiveServer, oai: openai.OpenAI, model_id: str, media_corpus: Any
) -> None:
    for name in ("truncated.png", "bomb-100000x100000.png", "zip-named.png"):
        parts: Any = [
            {"type": "text", "text": "Look:"},
            {"type": "image_url", "image_url": {"url": data_url(media_corpus.bytes(name))}},
        ]
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": parts}], max_tokens=1
            )
        assert "messages.0.content.1" in caught.value.message, name
    assert httpx.get(vision_server.url + "/health", timeout=10).status_code == 200
    test_n_choices_share_the_image(oai, model_id)  # and it still answers images


def _big_png(side: int) -> bytes:
    return png_bytes(Image.new("RGB", (side, side), (90, 140, 200)))


def _vm_hwm(pid: int) -> int:
    """The process's peak resident memory so far, in bytes (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_images_over_the_context_are_refused_before_decoding(
    vision_server: LiveServer, oai: openai.OpenAI, model_id: str
) -> None:
    """Eight 6000x6000 PNGs cost more prompt tokens than the context holds: that is known
    from their headers, so the context-length 400 comes before any is decoded. Shown two
    ways: images holding only their header (their decoding would fail, a different 400) get
    the context 400, and whole ones leave the server's peak memory below one decoded image
    (108 MB as RGB; decoding all eight took about 1 GB)."""
    big = _big_png(6000)
    for images in ([big[:64]] * 8, [big] * 8):
        parts: Any = [{"type": "text", "text": "Look:"}]
        parts += [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
        peak = _vm_hwm(vision_server.process.pid)
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": parts}], max_tokens=1
            )
        error = caught.value.body
        assert isinstance(error, dict) and error["code"] == "context_length_exceeded", error
        assert "the 8 images take at least" in error["message"]
        assert _vm_hwm(vision_server.process.pid) - peak < 100 * 2**20
    assert httpx.get(vision_server.url + "/health", timeout=10).status_code == 200


def test_image_tokens_counted_before_decoding_include_their_expansion(
    oai: openai.OpenAI, model_id: str
) -> None:
    """Four 6000x6000 images split into 3x3 tiles: 40 placeholders each, 160 in all, under the
    256-token context, but each expansion is 65 tokens (the tiles' markers, the newlines, the
    global view's): 260 leave no room to generate, which the headers already say. Images
    holding only their header (their decoding would fail, a different 400) show it comes
    before decoding."""
    header = _big_png(6000)[:64]
    parts: Any = [{"type": "text", "text": "Look:"}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(header)}} for _ in range(4)]
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": parts}], max_tokens=1
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "context_length_exceeded", error
    assert "the 4 images take at least 260 prompt tokens" in error["message"]


def test_images_over_the_pixel_budget_are_refused_before_decoding(
    oai: openai.OpenAI, model_id: str
) -> None:
    """Five 12000x3000 images fit the context (1x3 tiles: under 30 tokens each) but hold 180 M
    pixels, more than --max-decoded-pixels (144 M) holds at once: a 400 known from the
    headers, so images holding only their header (their decoding would fail, a different
    400) get it too."""
    header = png_bytes(Image.new("RGB", (12000, 3000), (90, 140, 200)))[:64]
    parts: Any = [{"type": "text", "text": "Look:"}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(header)}} for _ in range(5)]
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": parts}], max_tokens=1
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "media_too_large", error
    assert "--max-decoded-pixels" in error["message"]


def test_audio_is_refused_by_the_image_model(oai: openai.OpenAI, model_id: str) -> None:
    parts: Any = [{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": parts}], max_tokens=1
        )
    assert "does not accept audio" in caught.value.message


def test_file_urls_only_under_the_allowed_root(
    oai: openai.OpenAI, model_id: str, media_dirs: tuple[Path, Path]
) -> None:
    inside, outside = (d / "picture.png" for d in media_dirs)
    reply = oai.chat.completions.create(
        model=model_id, messages=image_turn(inside.as_uri()), max_tokens=2, temperature=0
    )
    same = oai.chat.completions.create(
        model=model_id,
        messages=image_turn(data_url(inside.read_bytes())),
        max_tokens=2,
        temperature=0,
    )
    assert reply.usage == same.usage and reply.choices[0].message == same.choices[0].message
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(
            model=model_id, messages=image_turn(outside.as_uri()), max_tokens=2
        )
    assert "outside the allowed media roots" in caught.value.message


def test_anthropic_image_block_answers_and_counts_its_tokens(
    claude: anthropic.Anthropic, model_id: str, tiny_idefics3: tuple[Path, Any, Any]
) -> None:
    image = generated(70, 50, seed=1)
    prompt_tokens, new_ids, text = reference(tiny_idefics3, image, QUESTION)
    source = {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(png_bytes(image)).decode(),
    }
    messages: Any = [
        {
            "role": "user",
            "content": [
                {"type": "image", "source": source},
                {"type": "text", "text": QUESTION},
            ],
        }
    ]
    msg = claude.messages.create(
        model=model_id, max_tokens=NEW, messages=messages, extra_body={"temperature": 0}
    )
    assert msg.usage.input_tokens == prompt_tokens
    assert msg.usage.output_tokens == len(new_ids)
    assert "".join(b.text for b in msg.content if b.type == "text") == text
    counted = claude.messages.count_tokens(model=model_id, messages=messages)
    assert counted.input_tokens == prompt_tokens


def test_anthropic_url_block_streams_like_its_base64_twin(
    claude: anthropic.Anthropic, model_id: str, media_dirs: tuple[Path, Path]
) -> None:
    picture = media_dirs[0] / "picture.png"

    def ask(source: dict[str, str]) -> tuple[str, int]:
        blocks: Any = [{"type": "text", "text": "Here:"}, {"type": "image", "source": source}]
        with claude.messages.stream(
            model=model_id,
            max_tokens=4,
            messages=[{"role": "user", "content": blocks}],
            extra_body={"temperature": 0},
        ) as stream:
            final = stream.get_final_message()
        text = "".join(b.text for b in final.content if b.type == "text")
        return text, final.usage.input_tokens

    by_url = ask({"type": "url", "url": picture.as_uri()})
    data = base64.b64encode(picture.read_bytes()).decode()
    assert by_url == ask({"type": "base64", "media_type": "image/png", "data": data})
    text_only = claude.messages.count_tokens(
        model=model_id, messages=[{"role": "user", "content": "Here:"}]
    )
    assert by_url[1] > text_only.input_tokens + 4  # the image's tile tokens are in the count


def test_an_image_outside_a_user_turn_is_refused(oai: openai.OpenAI, model_id: str) -> None:
    part = {"type": "image_url", "image_url": {"url": data_url(png_bytes(generated(8, 8)))}}
    messages: Any = [{"role": "system", "content": [part]}, {"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=model_id, messages=messages, max_tokens=1)
    assert "messages.0.content.0: images are accepted in user messages only" in str(
        caught.value.message
    )
