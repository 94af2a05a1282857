"""`inferd serve` on a tiny random Gemma 4 directory (image, video and audio encoders): one
request holding a PNG, a WAV and an MP4 with text, sent through the strict OpenAI SDK, reaches
the model as transformers' Gemma 4 takes them. The oracle: the prompt transformers' own
processor writes (its chat template, then its image, audio and video replacements, the video's
``mm:ss`` times from the frames its sampling keeps), usage equal to that prompt's length, and the
greedy reply equal to Gemma4ForConditionalGeneration's generate on the same pixels and features,
streamed and not; the same media twice are encoded once. An image likewise through the
Anthropic (with count_tokens) and Responses APIs, which carry no audio or video part.

The video's frames are made at the size the processor keeps (no resize), since transformers'
video processor resizes with torchvision, which is not installed here."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from inferd.loading.hf_processor import read_gemma4_video_config
from inferd.media.video import decode_video
from inferd.models.config import config_from_hf
from inferd.models.gemma4_image import PreparedGemma4Image
from inferd.models.gemma4_video import Gemma4VideoConfig
from tests.media.corpus import Clip, Tone, _mp4, wav_bytes
from tests.models.test_idefics3_processor import generated
from tests.models.tiny_gemma4 import AUDIO, IMAGE, VIDEO, VIDEO_FRAMES, mm_token_id
from tests.server.live import LiveServer, live_server
from tests.server.media_replies import (
    Greedy,
    Reply,
    assert_greedy_reply,
    encoder_calls,
    greedy_chat,
    image_on_anthropic_and_responses,
    streamed_text,
    transformers_greedy,
    wav_part,
    wav_samples,
)
from tests.server.test_vision_live import data_url, png_bytes

NEW = 8
LOGPROB_TOLERANCE = 1e-4  # float32 on both sides: only summation order differs (~1e-6)
QUESTION = "What do the picture, the sound and the clip show?"
FRAME_SIZE = (72, 56)  # (width, height): a frame the video processor keeps as it is
Tiny = tuple[Path, Any, Any]


@pytest.fixture(scope="module")
def server(tiny_gemma4: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("gemma4-serve") / "serve.log"
    with live_server(["-m", str(tiny_gemma4[0]), "--dtype", "f32"], log) as live:
        yield live


@pytest.fixture(scope="module")
def video_cfg(tiny_gemma4: Tiny) -> Gemma4VideoConfig:
    cfg = config_from_hf(json.loads((tiny_gemma4[0] / "config.json").read_text()))
    found = read_gemma4_video_config(tiny_gemma4[0], cfg)
    assert found is not None and found.num_frames == VIDEO_FRAMES
    return found


def _video_bytes() -> bytes:
    # 20 frames at 8 fps (2.5 s): 4 kept, frames 0, 5, 10, 15 at 0, 0.625, 1.25, 1.875 s
    return _mp4(Clip(fps=Fraction(8), frames=20, size=FRAME_SIZE), None)


TONE = Tone(16_000, 0.9, (440.0,))


def reference(tiny: Tiny, parts: list[str], question: str, picture: Any = None) -> Greedy:
    """transformers' greedy reply to one user turn: ``parts`` (image, audio, video, in this
    order when present), then ``question``; the video's frames as the server's sampling keeps
    them, each prepared at the video budget."""
    directory, hf, processor = tiny
    tok = processor.tokenizer
    content = [{"type": kind} for kind in parts] + [{"type": "text", "text": question}]
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs: dict[str, Any] = {}
    if "image" in parts:
        images = processor.image_processor([picture], return_tensors="pt")
        text = text.replace(IMAGE, processor.replace_image_token(images, 0), 1)
        inputs |= {"pixel_values": images["pixel_values"]}
        inputs |= {"image_position_ids": images["image_position_ids"]}
    if "audio" in parts:
        features = processor.feature_extractor([wav_samples(wav_bytes(TONE))], return_tensors="pt")
        text = text.replace(AUDIO, processor.replace_audio_token(features, 0), 1)
        inputs |= {"input_features": features["input_features"]}
        inputs |= {"input_features_mask": features["input_features_mask"]}
    if "video" in parts:
        text, video_inputs = _video_reference(directory, processor, text)
        inputs |= video_inputs
    ids = tok(text, add_special_tokens=False)["input_ids"]
    input_ids = torch.tensor([ids])
    types = (
        (input_ids == mm_token_id(IMAGE)).long()
        + 2 * (input_ids == mm_token_id(VIDEO)).long()
        + 3 * (input_ids == mm_token_id(AUDIO)).long()
    )
    inputs |= {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    inputs |= {"mm_token_type_ids": types}
    return transformers_greedy(hf, inputs, tok, NEW)


def _video_reference(directory: Path, processor: Any, text: str) -> tuple[str, dict[str, Any]]:
    """The prompt with the processor's video replacement, and the video inputs laid out as its
    video processor lays them (patches padded to the budget, (-1, -1) places for padding)."""
    from transformers.video_utils import VideoMetadata

    cfg = config_from_hf(json.loads((directory / "config.json").read_text()))
    video_cfg = read_gemma4_video_config(directory, cfg)
    assert video_cfg is not None
    decoded = decode_video(_video_bytes(), sampling=video_cfg)
    assert decoded.frame_indices == (0, 5, 10, 15) and decoded.fps == 8.0
    frames: list[PreparedGemma4Image] = video_cfg.prepare(decoded.frames)
    assert tuple(frames[0].positions.max(0).values + 1) == (18, 14)  # 72x56 px kept whole
    metadata = VideoMetadata(
        total_num_frames=decoded.total_frames,
        fps=decoded.fps,
        frames_indices=list(decoded.frame_indices),
    )
    video = {"num_soft_tokens_per_video": [frames[0].num_soft_tokens], "video_metadata": [metadata]}
    text = text.replace(VIDEO, processor.replace_video_token(video, 0), 1)
    budget = video_cfg.frames.max_patches
    pixels = torch.zeros(len(frames), budget, frames[0].patches.shape[1])
    places = torch.full((len(frames), budget, 2), -1, dtype=torch.long)
    for i, frame in enumerate(frames):
        pixels[i, : frame.patches.shape[0]] = frame.patches
        places[i, : frame.positions.shape[0]] = frame.positions
    return text, {
        "pixel_values_videos": pixels,
        "video_position_ids": places,
        "num_frames_per_video": torch.tensor([len(frames)]),
    }


def _ask(client: openai.OpenAI, image: bytes, **more: Any) -> Any:
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        wav_part(wav_bytes(TONE)),
        {"type": "video_url", "video_url": {"url": data_url(_video_bytes(), "video/mp4")}},
        {"type": "text", "text": QUESTION},
    ]
    return greedy_chat(client, parts, NEW, **more)


def test_models_lists_image_video_and_audio_input(server: LiveServer) -> None:
    card = httpx.get(server.api + "/models", timeout=10).json()["data"][0]
    assert card["modalities"]["input"] == ["text", "image", "video", "audio"]


def test_a_png_a_wav_and_an_mp4_reach_the_model_as_transformers_takes_them(
    client: openai.OpenAI, tiny_gemma4: Tiny, server: LiveServer
) -> None:
    picture = generated(30, 44, seed=51)
    expected = reference(tiny_gemma4, ["image", "audio", "video"], QUESTION, picture)
    times = re.findall(r"\d\d:\d\d ", tiny_gemma4[2].tokenizer.decode(expected.ids))
    assert len(times) == VIDEO_FRAMES  # the prompt holds each frame after its time

    reply = _ask(client, png_bytes(picture), logprobs=True)
    assert_greedy_reply(reply, expected, LOGPROB_TOLERANCE)  # each medium's tokens, the times

    calls_before = encoder_calls(server)
    assert streamed_text(_ask(client, png_bytes(picture), stream=True)) == expected.text
    assert encoder_calls(server) == calls_before  # the image, clip and frames were cached


def test_an_image_reaches_the_model_on_the_anthropic_and_responses_apis(
    server: LiveServer, client: openai.OpenAI, tiny_gemma4: Tiny
) -> None:
    picture = generated(40, 26, seed=53)
    question = "Describe it."
    expected = reference(tiny_gemma4, ["image"], question, picture)
    url = data_url(png_bytes(picture))
    claude, responses, counted = image_on_anthropic_and_responses(
        server, client, url, question, NEW
    )
    assert claude == responses == Reply(len(expected.ids), expected.text)
    assert counted == len(expected.ids)
