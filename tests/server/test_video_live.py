"""`inferd serve` on a tiny SmolVLM2 directory with videos: /v1/models says it takes video, and a
``video_url`` part (OpenAI's extension as mistral.rs and vLLM take it: a data: URL, or file://
under --allowed-media-root) sent with the official OpenAI SDK (strict) reaches the model as
transformers' SmolVLM processor prepares it: usage counts the frames' tokens and the greedy
reply equals transformers' generate on the same frames and prompt."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.models.test_smolvlm_video import (
    mp4,
    reference_pixels,
    reference_prompt,
    reference_video,
)
from tests.models.tiny_vlm import save_tiny_smolvlm
from tests.server.live import LiveServer, live_server

NEW = 8
QUESTION = "What happens in this clip?"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    directory = tmp_path_factory.mktemp("tiny-smolvlm2-live")
    hf, tokenizer, _ = save_tiny_smolvlm(directory)
    return directory, hf, tokenizer


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("video-media") / "clip.mp4"
    path.write_bytes(mp4(Fraction(30000, 1001), 50, 45, 31, seed=8))
    return path


@pytest.fixture(scope="module")
def server(
    tiny: tuple[Path, Any, Any], clip: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("video-serve") / "serve.log"
    args = ["-m", str(tiny[0]), "--dtype", "f32", "--allowed-media-root", str(clip.parent)]
    with live_server(args, log) as live:
        yield live


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=server.api, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as client:
        yield client


def reference(tiny: tuple[Path, Any, Any], clip: Path) -> tuple[int, list[int], str]:
    """transformers' prompt length, greedy ids and text for the clip and the question."""
    _, hf, tokenizer = tiny
    frames, metadata = reference_video(clip)
    messages = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text.replace("<video>", reference_prompt(len(frames), metadata)))["input_ids"]
    with torch.inference_mode():
        out = hf.generate(
            input_ids=torch.tensor([ids]),
            pixel_values=reference_pixels(frames)[None],
            max_new_tokens=NEW,
            do_sample=False,
        )
    new = out[0, len(ids) :].tolist()
    return len(ids), new, tokenizer.decode(new, skip_special_tokens=True)


def test_models_lists_video_input(server: LiveServer) -> None:
    card = httpx.get(server.api + "/models", timeout=10).json()["data"][0]
    assert card["modalities"]["input"] == ["text", "image", "video"]


@pytest.mark.parametrize("how", ["data", "file"])
def test_a_video_reaches_the_model_as_transformers_sees_it(
    oai: openai.OpenAI, server: LiveServer, tiny: tuple[Path, Any, Any], clip: Path, how: str
) -> None:
    prompt_tokens, new_ids, text = reference(tiny, clip)
    if how == "data":
        url = "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()
    else:
        url = clip.as_uri()
    model = httpx.get(server.api + "/models", timeout=10).json()["data"][0]["id"]
    parts: list[Any] = [
        {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": QUESTION},
    ]
    chunks = list(
        oai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": parts}],
            max_tokens=NEW,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.prompt_tokens == prompt_tokens  # the frames' tokens and their timestamps
    assert usage.completion_tokens == len(new_ids)
    assert answer == text


def test_a_video_outside_the_media_root_is_refused(
    oai: openai.OpenAI, server: LiveServer, tmp_path: Path, clip: Path
) -> None:
    elsewhere = tmp_path / "clip.mp4"
    elsewhere.write_bytes(clip.read_bytes())
    model = httpx.get(server.api + "/models", timeout=10).json()["data"][0]["id"]
    part = {"type": "video_url", "video_url": {"url": elsewhere.as_uri()}}
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": [part]}], max_tokens=2
        )
    assert "video_url" in str(caught.value)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
