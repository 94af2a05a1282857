"""The seed's worked example, live (``python -m inferd.contract.example --live``): ``inferd
serve --config`` with three tiny random models under the contract's supervisor. The PNG, the WAV
and the MP4 with the text go to one model (Gemma 4) in one request; then, routed by modality,
the PNG and the MP4 to SmolVLM2 and the WAV to Qwen2-Audio. Each is a strict stream read to
Complete with usage counting the media. Then each piece of evidence is shown to reach its model:
changing only the image, only the video or only the audio changes the prompt tokens of the
requests that carry it, and no others."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.contract import example
from inferd.contract.fixtures import tiny_png, tiny_wav
from inferd.contract.live import (
    AUDIO_ROUTE,
    NOTE,
    ONE_MODEL_ROUTE,
    VISION_ROUTE,
    Answer,
    LiveScenario,
    evidence,
    run_live,
    tiny_video,
)
from tests.models.build_tiny import build


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny-checkpoints")
    build(root)
    return root


@pytest.fixture(scope="module")
def live(checkpoints: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveScenario]:
    with LiveScenario(tmp_path_factory.mktemp("live-scenario"), checkpoints) as scenario:
        yield scenario


def vision(live: LiveScenario, png: bytes, mp4: bytes) -> Answer:
    return live.ask(VISION_ROUTE, [(png, "evidence://png"), (mp4, "evidence://mp4")])


def audio(live: LiveScenario, wav: bytes) -> Answer:
    return live.ask(AUDIO_ROUTE, [(wav, "evidence://wav")])


def everything(live: LiveScenario, png: bytes, wav: bytes, mp4: bytes) -> Answer:
    items = [(png, "evidence://png"), (wav, "evidence://wav"), (mp4, "evidence://mp4")]
    return live.ask(ONE_MODEL_ROUTE, items)


def test_the_report_is_complete_for_one_model_and_for_two(
    checkpoints: Path, tmp_path: Path
) -> None:
    report = run_live(tmp_path, checkpoints)
    assert report["success"] and report["note"] == NOTE
    assert report["launch"]["argv"][:2] == ["serve", "--config"]
    assert "--allowed-media-root" in report["launch"]["argv"]
    one = report["one_model"]
    assert one["route"] == ONE_MODEL_ROUTE
    assert list(one["part_types"]) == ["image_url", "audio_url", "video_url", "text"]
    seen, heard = report["two_models"]
    assert seen["route"] == VISION_ROUTE and heard["route"] == AUDIO_ROUTE
    assert list(seen["part_types"]) == ["image_url", "video_url", "text"]
    assert list(heard["part_types"]) == ["audio_url", "text"]
    for answer in (one, seen, heard):
        assert answer["outcome"] == "complete"
        usage = answer["usage"]
        assert usage["completion_tokens"] >= 1
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_media_tokens_are_counted(live: LiveScenario) -> None:
    media = evidence()
    bare = live.ask(ONE_MODEL_ROUTE, []).usage
    together = everything(live, media.png, media.wav, media.mp4).usage
    assert bare is not None and together is not None
    # the 40x30 PNG: 63 soft tokens (resized to 72x56 px); 0.8 s of audio: 20 rows; the MP4's
    # 4 kept frames (32x24 px) of 63 soft tokens each, each after its time
    assert together["prompt_tokens"] - bare["prompt_tokens"] > 63 + 20 + 4 * 63
    text_only = live.ask(VISION_ROUTE, []).usage
    seen = vision(live, media.png, media.mp4).usage
    assert text_only is not None and seen is not None
    # a 40x30 PNG: 3x3 tiles and the global view, 4 tokens each; 8 frames at 4 fps: 4 frames
    assert seen["prompt_tokens"] - text_only["prompt_tokens"] > 10 * 4 + 4 * 4
    heard, bare = audio(live, media.wav).usage, live.ask(AUDIO_ROUTE, []).usage
    assert heard is not None and bare is not None
    assert heard["prompt_tokens"] > bare["prompt_tokens"]


@pytest.mark.parametrize("changed", ["image", "video", "audio"])
def test_changing_one_piece_of_evidence_changes_its_prompt(
    live: LiveScenario, changed: str
) -> None:
    media = evidence()
    png = tiny_png(48, 12) if changed == "image" else media.png  # 1x3 tiles, not 3x3
    # 4 s: SmolVLM2 keeps 8 frames, not 4; Gemma 4 keeps 4 either way, of 56 soft tokens (48x16
    # px), not 63
    mp4 = tiny_video(16, size=(48, 16)) if changed == "video" else media.mp4
    wav = tiny_wav(16000, 2500) if changed == "audio" else media.wav  # longer: more rows
    base_one = everything(live, media.png, media.wav, media.mp4)
    base_seen, base_heard = vision(live, media.png, media.mp4), audio(live, media.wav)
    one = everything(live, png, wav, mp4)
    seen, heard = vision(live, png, mp4), audio(live, wav)
    for answer in (base_one, base_seen, base_heard, one, seen, heard):
        assert answer.outcome == "complete" and answer.usage is not None
    assert base_one.usage and one.usage
    assert base_seen.usage and seen.usage and base_heard.usage and heard.usage
    assert one.usage["prompt_tokens"] != base_one.usage["prompt_tokens"]
    vision_moved = seen.usage["prompt_tokens"] != base_seen.usage["prompt_tokens"]
    audio_moved = heard.usage["prompt_tokens"] != base_heard.usage["prompt_tokens"]
    assert (vision_moved, audio_moved) == (changed != "audio", changed == "audio")


def test_example_flags_need_live(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        example.main(["--checkpoints", "/nowhere"])
    assert "--live" in capsys.readouterr().err
