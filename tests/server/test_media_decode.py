"""A request's media checked, loaded and decoded by the server (decode_request_media), then the
same through the real chat and messages routes of an app serving the real model.

No model here can see, so the models that accept media are the real SmolLM2 under a subclass
declaring image, audio and video input: the refusals below happen before the model is used,
and a text request afterwards shows the server answers as before.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx
import numpy as np
import pytest

from inferd.media.limits import MediaLimits
from inferd.media.types import DecodedAudio, DecodedImage, DecodedVideo
from inferd.media.video import VideoSampling
from inferd.server.app import build_app
from inferd.server.errors import APIError
from inferd.server.media import MediaPolicy, Modalities, decode_request_media
from inferd.server.options import ServerOptions
from inferd.serving.served import ServedModel
from tests.media.corpus import Corpus

ALL = Modalities(("text", "image", "audio", "video"))


@dataclass(frozen=True)
class Card:
    id: str
    modalities: Modalities = field(default_factory=Modalities)


SEEING = Card("seeing", ALL)
TEXT = Card("smollm2")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{b64(data)}"


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def decode(messages: Any, policy: MediaPolicy | None = None, model: Any = SEEING, **kw: Any) -> Any:
    return asyncio.run(decode_request_media(messages, policy or MediaPolicy(), model, **kw))


def refused(messages: Any, policy: MediaPolicy | None = None, model: Any = SEEING) -> APIError:
    with pytest.raises(APIError) as info:
        decode(messages, policy, model)
    err = info.value
    assert err.status == 400 and err.param is not None
    assert err.message.startswith(f"{err.param}: ")
    return err


def test_every_part_kind_is_decoded_in_order(media_corpus: Corpus) -> None:
    c = media_corpus
    policy = MediaPolicy.create(media_roots=[c.root])
    png, jpg = c.bytes("rgb-tiny-7x5.png"), c.bytes("rgb-photo-320x240.jpg")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare"},
                image_part(data_url(png, "image/png")),
                {
                    "type": "input_audio",
                    "input_audio": {"data": b64(c.bytes("s16-mono-16k.wav")), "format": "wav"},
                },
                {"type": "video_url", "video_url": {"url": f"file://{c.root}/gray-7.5fps.mp4"}},
                {"type": "audio_url", "audio_url": {"url": f"file://{c.root}/s16-stereo-44k.flac"}},
            ],
        },
        {"role": "assistant", "content": "ok"},
        {
            "role": "user",
            "content": [  # Anthropic blocks
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/jpeg", "data": b64(jpg)},
                },
                {
                    "type": "image",
                    "source": {"type": "url", "url": f"file://{c.root}/exif-rotated-40x20.jpg"},
                },
            ],
        },
    ]
    media = decode(messages, policy)
    assert [type(m) for m in media] == [
        DecodedImage,
        DecodedAudio,
        DecodedVideo,
        DecodedAudio,
        DecodedImage,
        DecodedImage,
    ]
    first, wav, video, flac, photo, rotated = media
    assert isinstance(first, DecodedImage) and first.size == (7, 5) and first.format == "PNG"
    assert isinstance(wav, DecodedAudio) and wav.sample_rate == 16000 and wav.format == "WAV"
    assert isinstance(video, DecodedVideo) and video.total_frames == 20
    assert isinstance(flac, DecodedAudio) and flac.channels == 2 and flac.sample_rate == 44100
    assert isinstance(photo, DecodedImage) and photo.size == (320, 240)
    assert isinstance(rotated, DecodedImage) and rotated.size == (20, 40)
    assert len({m.digest for m in media}) == 6


def test_audio_is_resampled_and_video_sampled_as_the_model_asks(media_corpus: Corpus) -> None:
    wav = media_corpus.bytes("s16-stereo-22k.wav")
    mp4 = media_corpus.bytes("gray-7.5fps.mp4")
    messages = user(
        {"type": "input_audio", "input_audio": {"data": b64(wav), "format": "wav"}},
        {"type": "video_url", "video_url": {"url": data_url(mp4, "video/mp4")}},
    )
    audio, video = decode(messages, audio_rate=16000, video_sampling=VideoSampling(1.0, 2))
    assert isinstance(audio, DecodedAudio) and audio.sample_rate == 16000
    assert audio.num_samples == math.ceil(16538 * 16000 / 22050)  # 0.75 s at 22050 Hz, rounded
    assert isinstance(video, DecodedVideo) and video.frame_indices == (0, 10)
    assert video.audio is None
    sound = media_corpus.bytes("gray-29.97fps-audio.mp4")
    (heard,) = decode(
        user({"type": "video_url", "video_url": {"url": data_url(sound, "video/mp4")}}),
        audio_rate=8000,
        video_audio=True,
    )
    assert isinstance(heard, DecodedVideo) and heard.audio is not None
    assert heard.audio.sample_rate == 8000 and heard.audio.digest == heard.digest


CORRUPT = [
    # part, the param the error names, what it says, its code
    (
        lambda c: image_part(data_url(c.bytes("garbage-after-magic.png"), "image/png")),
        "messages.0.content.1.image_url",
        "the PNG image cannot be decoded: broken PNG file",
        "invalid_media",
    ),
    (
        lambda c: {
            "type": "image_url",
            "image_url": data_url(c.bytes("zip-named.png"), "image/png"),
        },
        "messages.0.content.1.image_url",
        "is a ZIP archive, not an image",
        "invalid_media",
    ),
    (
        lambda c: image_part(f"file://{c.root}/zip-named.png"),
        "messages.0.content.1.image_url",
        "is a ZIP archive, not an image",
        "invalid_media",
    ),
    (
        lambda c: image_part(f"file://{c.root}/bomb-7000x7000.png"),
        "messages.0.content.1.image_url",
        "7000x7000 = 49000000 pixels",
        "media_too_large",
    ),
    (
        lambda c: image_part(data_url(c.bytes("rgb-photo-320x240.jpg"), "image/png")),
        "messages.0.content.1.image_url",
        "'image/png' does not match the data, which is a JPEG file",
        "media_type_mismatch",
    ),
    (
        lambda c: {
            "type": "input_audio",
            "input_audio": {"data": b64(c.bytes("s16-stereo-44k.flac")), "format": "wav"},
        },
        "messages.0.content.1.input_audio",
        "'audio/wav' does not match the data, which is a FLAC file",
        "media_type_mismatch",
    ),
    (
        lambda c: {
            "type": "input_audio",
            "input_audio": {"data": b64(c.bytes("lying-length.wav")), "format": "wav"},
        },
        "messages.0.content.1.input_audio",
        "declares 64000 bytes of audio but the file holds 32000",
        "invalid_media",
    ),
    (
        lambda c: {"type": "video_url", "video_url": {"url": f"file://{c.root}/aac-mono-16k.m4a"}},
        "messages.0.content.1.video_url",
        "the MP4 file has no video stream",
        "invalid_media",
    ),
    (
        lambda c: {"type": "audio_url", "audio_url": {"url": f"file://{c.root}/truncated.wav"}},
        "messages.0.content.1.audio_url",
        "it is truncated",
        "invalid_media",
    ),
    (
        lambda c: {
            "type": "image",
            "source": {
                "type": "base64",
                "media_type": "image/png",
                "data": b64(c.bytes("truncated.png")),
            },
        },
        "messages.0.content.1.source",
        "image file is truncated",
        "invalid_media",
    ),
]


@pytest.mark.parametrize(("part", "param", "says", "code"), CORRUPT)
def test_bad_media_is_a_400_naming_the_part(
    media_corpus: Corpus, part: Any, param: str, says: str, code: str
) -> None:
    err = refused(user(part(media_corpus)), MediaPolicy.create(media_roots=[media_corpus.root]))
    assert err.param == param and err.code == code
    assert says in err.message


def test_a_file_name_declares_nothing_and_pcm16_is_raw_samples(
    media_corpus: Corpus, tmp_path: Path
) -> None:
    (tmp_path / "photo.png").write_bytes(media_corpus.bytes("rgb-photo-320x240.jpg"))
    policy = MediaPolicy.create(media_roots=[tmp_path])
    (image,) = decode(user(image_part(f"file://{tmp_path}/photo.png")), policy)
    assert isinstance(image, DecodedImage) and image.format == "JPEG"
    samples = (np.sin(np.arange(2400) / 10) * 20000).astype("<i2")
    pcm = {"data": b64(samples.tobytes()), "format": "pcm16"}
    (audio,) = decode(user({"type": "input_audio", "input_audio": pcm}))
    assert isinstance(audio, DecodedAudio) and audio.sample_rate == 24000
    assert np.array_equal(audio.samples[0], samples.astype(np.float32) / 32768)
    odd = {"data": b64(samples.tobytes()[:-1]), "format": "pcm16"}
    err = refused(user({"type": "input_audio", "input_audio": odd}))
    assert err.param == "messages.0.content.1.input_audio" and "whole 16-bit samples" in err.message


def test_remote_media_is_fetched_then_decoded(media_corpus: Corpus) -> None:
    """Through the SSRF-safe fetcher, from an HTTP server on loopback (a network allowed here)."""
    files = {
        "/photo.jpg": media_corpus.bytes("rgb-photo-320x240.jpg"),
        "/cat.png": media_corpus.bytes("zip-named.png"),
    }

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        body = files[head.split(b" ")[1].decode()]
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
        )
        await writer.drain()
        writer.close()

    async def main() -> tuple[Any, APIError]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        policy = MediaPolicy.create(
            allow_remote=True, remote_ports=[port], allow_networks=["127.0.0.0/8"]
        )
        try:
            good = await decode_request_media(
                user(image_part(f"http://127.0.0.1:{port}/photo.jpg")), policy, SEEING
            )
            with pytest.raises(APIError) as info:
                await decode_request_media(
                    user(image_part(f"http://127.0.0.1:{port}/cat.png")), policy, SEEING
                )
            return good, info.value
        finally:
            server.close()
            await server.wait_closed()

    (image,), err = asyncio.run(main())
    assert isinstance(image, DecodedImage) and image.size == (320, 240)
    local = decode(user(image_part(data_url(files["/photo.jpg"], "image/jpeg"))))[0]
    assert image.digest == local.digest
    assert np.array_equal(np.asarray(image.image), np.asarray(local.image))
    assert err.param == "messages.0.content.1.image_url" and "is a ZIP archive" in err.message


def test_decoding_limits_come_from_the_policy(media_corpus: Corpus) -> None:
    policy = MediaPolicy.create(limits=MediaLimits(max_video_seconds=1.0))
    mp4 = data_url(media_corpus.bytes("gray-7.5fps.mp4"), "video/mp4")
    err = refused(user({"type": "video_url", "video_url": {"url": mp4}}), policy)
    assert err.code == "media_too_large" and "(--max-video-seconds)" in err.message


def test_counts_per_modality_are_capped_before_anything_is_read(media_corpus: Corpus) -> None:
    policy = MediaPolicy.create(max_num_audios=1, max_num_videos=1)
    audio = {"type": "audio_url", "audio_url": {"url": "file:///nowhere.wav"}}
    video = {"type": "video_url", "video_url": "file:///nowhere.mp4"}
    err = refused(user(audio, audio), policy)
    assert err.param == "messages" and err.code == "too_many_audios"
    assert (
        "carries 2 audio clips; this server accepts at most 1 per request (--max-num-audios)"
        in (err.message)
    )
    err = refused(user(video, video), policy)
    assert err.code == "too_many_videos" and "(--max-num-videos)" in err.message
    with pytest.raises(ValueError, match="--max-num-videos must not be negative"):
        MediaPolicy.create(max_num_videos=-1)


def test_a_text_model_refuses_media_before_decoding_it(media_corpus: Corpus) -> None:
    """The corrupt PNG would be an invalid_media 400; a text model stops at the modality."""
    corrupt = image_part(data_url(media_corpus.bytes("garbage-after-magic.png"), "image/png"))
    err = refused(user(corrupt), model=TEXT)
    assert err.code == "unsupported_modality" and err.param == "messages.0.content.1"
    assert "does not accept image input; it accepts text" in err.message


def test_text_only_requests_decode_nothing() -> None:
    assert decode([{"role": "user", "content": "hi"}], model=TEXT) == []


# -- through the routes of an app serving the real model -----------------------------------------
class SeeingModel(ServedModel):
    """The real model, declared able to take images, audio and video (no such model yet)."""

    modalities: ClassVar[Modalities] = ALL


async def _requests(app: object, calls: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    headers = {"anthropic-version": "2023-06-01"}
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return [await client.post(p, json=b, headers=headers, timeout=120) for p, b in calls]


def test_the_routes_answer_bad_media_with_a_400_and_keep_serving(
    served_f32: ServedModel, media_corpus: Corpus, tmp_path: Path
) -> None:
    seeing = SeeingModel(
        **{f.name: getattr(served_f32, f.name) for f in dataclasses.fields(served_f32)}
    )
    options = ServerOptions(media_policy=MediaPolicy.create(media_roots=[media_corpus.root]))
    app = build_app([seeing], options)
    garbage = b64(media_corpus.bytes("garbage-after-magic.png"))
    chat = {"model": seeing.id, "max_tokens": 3, "temperature": 0}
    openai_bad = {**chat, "messages": user(image_part(f"data:image/png;base64,{garbage}"))}
    anthropic_bad = {
        **chat,
        "messages": user(
            {
                "type": "image",
                "source": {"type": "base64", "media_type": "image/png", "data": garbage},
            }
        ),
    }
    no_video = {
        **chat,
        "messages": user(
            {
                "type": "video_url",
                "video_url": {"url": f"file://{media_corpus.root}/aac-mono-16k.m4a"},
            }
        ),
    }
    fine = {**chat, "messages": [{"role": "user", "content": "Say hi."}]}
    responses = asyncio.run(
        _requests(
            app,
            [
                ("/v1/chat/completions", openai_bad),
                ("/v1/messages", anthropic_bad),
                ("/v1/chat/completions", no_video),
                ("/v1/chat/completions", fine),
                ("/v1/messages", fine),
            ],
        )
    )
    bad, anthropic, video, ok_openai, ok_anthropic = responses
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"] == "messages.0.content.1.image_url" and error["code"] == "invalid_media"
    assert "the PNG image cannot be decoded: broken PNG file" in error["message"]
    assert anthropic.status_code == 400
    assert anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["message"].startswith("messages.0.content.1.source: ")
    assert video.status_code == 400 and "no video stream" in video.json()["error"]["message"]
    assert ok_openai.status_code == 200
    assert ok_openai.json()["usage"]["completion_tokens"] >= 1
    assert ok_anthropic.status_code == 200 and ok_anthropic.json()["content"][0]["type"] == "text"
