"""``prompter_for``: each kind of model (text, Idefics3 and SmolVLM2 images, Qwen2-Audio,
Qwen2.5-VL grids) gets its prompter, chosen from the tiny checkpoints' own files, with the
modalities and pre-decode answers the server reads; and each prompter refuses a medium its
model does not take with the message the server has always given."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.loading.model import LoadedModel, load
from inferd.media.types import DecodedAudio, DecodedVideo
from inferd.serving.multimodal import MediaPromptError, image_digest
from inferd.serving.prompter import Prompter, prompter_for
from tests.models.test_idefics3_processor import generated
from tests.models.test_qwen2_5_vl_parity import frames

IMAGE = generated(40, 60, seed=1)
PICTURE = (IMAGE, image_digest(IMAGE))
CLIP = DecodedAudio(np.zeros((1, 1600), dtype=np.float32), 16000, "beep", "WAV")
VIDEO = DecodedVideo(
    frames=frames(2, 40, 40, 0),
    frame_indices=(0, 1),
    timestamps=(0.0, 0.5),
    fps=2.0,
    total_frames=2,
    duration=1.0,
    digest=hashlib.sha256(b"video").hexdigest(),
    format="MP4",
)


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.models.tiny import save_tiny

    directory = tmp_path_factory.mktemp("llama")
    save_tiny("llama", directory)
    return directory


@pytest.fixture(scope="module")
def tiny_smolvlm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.models.tiny_vlm import save_tiny_smolvlm

    directory = tmp_path_factory.mktemp("smolvlm2")
    save_tiny_smolvlm(directory)
    return directory


def _directory(request: pytest.FixtureRequest, fixture: str) -> Path:
    value: Any = request.getfixturevalue(fixture)
    return value if isinstance(value, Path) else value[0]  # the shared ones: (dir, hf, ...)


def _loaded(request: pytest.FixtureRequest, fixture: str) -> LoadedModel:
    return load(_directory(request, fixture), dtype="f32", progress=False)


@pytest.mark.parametrize(
    ("fixture", "kind", "modalities"),
    [
        ("tiny_text", "text", ("text",)),
        ("tiny_idefics3", "image", ("text", "image")),
        ("tiny_smolvlm2", "image", ("text", "image", "video")),
        ("tiny_qwen2_audio", "audio", ("text", "audio")),
        ("tiny_qwen2_5_vl", "grid", ("text", "image", "video")),
    ],
)
def test_each_model_kind_gets_its_prompter(
    request: pytest.FixtureRequest, fixture: str, kind: str, modalities: tuple[str, ...]
) -> None:
    loaded = _loaded(request, fixture)
    prompter = prompter_for(loaded)
    assert (prompter.kind, prompter.modalities) == (kind, modalities)
    assert prompter.model == loaded.source.name
    assert prompter.parts_content == (kind != "text")  # multimodal templates iterate parts
    assert (prompter.audio_sample_rate == 16000) == (kind == "audio")
    assert (prompter.video_sampling is not None) == (fixture == "tiny_smolvlm2")
    tokens = prompter.image_tokens(60, 40)
    assert (tokens is not None and tokens > 0) == ("image" in modalities)


@pytest.fixture(scope="module")
def prompters(request: pytest.FixtureRequest) -> dict[str, Prompter]:
    kinds = {"text": "tiny_text", "image": "tiny_idefics3", "audio": "tiny_qwen2_audio"}
    found = {kind: prompter_for(_loaded(request, f)) for kind, f in kinds.items()}
    return found | {"grid": prompter_for(_loaded(request, "tiny_qwen2_5_vl"))}


@pytest.mark.parametrize(
    ("kind", "media", "message"),
    [
        ("text", [PICTURE], "takes no images"),
        ("text", [CLIP], "takes no audio"),
        ("text", [VIDEO], "takes no video"),
        ("text", [PICTURE, CLIP], "takes images or audio in a prompt, not both"),
        ("image", [CLIP], "takes no audio"),
        ("image", [VIDEO, CLIP], "takes no video with audio"),
        ("image", [PICTURE, CLIP], "takes images or audio in a prompt, not both"),
        ("audio", [PICTURE], "takes no images"),
        ("audio", [VIDEO], "takes no video"),
        ("grid", [PICTURE, CLIP], "takes no audio"),
    ],
)
def test_a_medium_the_model_does_not_take_is_refused_by_name(
    prompters: dict[str, Prompter], kind: str, media: list[Any], message: str
) -> None:
    prompter = prompters[kind]
    with pytest.raises(MediaPromptError) as refused:
        prompter.prepare("<image><|AUDIO|><video>", media)
    assert str(refused.value) == f"{prompter.model} {message}"


def test_a_text_model_encodes_text_as_its_tokenizer_does(prompters: dict[str, Prompter]) -> None:
    text = prompters["text"]
    assert text.prepare("Hello there", []) == (
        text.tokenizer.encode("Hello there", add_special=True),
        [],
    )
