"""The engine on the tiny random Gemma 4 checkpoint (tests/models/tiny_gemma4.py) with an
image, an audio clip and a video in one prompt: the prompt's log-probabilities and the greedy
tokens do not depend on the step budget (at 8 tokens a step each image and video frame, 63
soft tokens, still arrives whole, its tokens seeing each other both ways), and media that do
not fit their placeholders are refused before they run. The served model against transformers
is tests/server/test_gemma4_live.py."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.llm_engine import AdmissionError
from inferd.engine.request import MediaInput
from inferd.engine.sampling import SamplingParams
from inferd.media.audio import decode_audio
from inferd.media.video import decode_video
from inferd.serving.multimodal import image_digest
from inferd.serving.served import ServedModel, load_model
from tests.media.corpus import Clip, Tone, _mp4, wav_bytes
from tests.models.test_idefics3_processor import generated

PROMPT = (
    "<start_of_turn>user\nSee <|image|>, hear <|audio|> and watch <|video|>: what now?"
    "<end_of_turn>\n<start_of_turn>model\n"
)


def served_with(directory: Path, **overrides: Any) -> ServedModel:
    settings: dict[str, Any] = {"dtype": "f32", "kv_cache_tokens": 4096, "max_model_len": 512}
    return load_model(
        directory, EngineConfig(**(settings | overrides)), progress=False, loop=CallerLoop()
    )


def prompt(served: ServedModel) -> tuple[list[int], list[MediaInput]]:
    picture = generated(30, 44, seed=61)
    clip = decode_audio(wav_bytes(Tone(16_000, 0.7, (330.0,))))
    video_cfg = served.prompter.video_sampling
    video = decode_video(
        _mp4(Clip(fps=Fraction(8), frames=12, size=(32, 24)), None), sampling=video_cfg
    )
    items = [(picture, image_digest(picture)), clip, video]
    return served.prompter.prepare(PROMPT, items)


def run(served: ServedModel, rid: str) -> tuple[list[float], list[int]]:
    """The prompt's log-probabilities (of each next prompt token) and 4 greedy tokens."""
    ids, media = prompt(served)
    engine = served.engine.engine
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0, ignore_eos=True)
    engine.add_request(rid, ids, params, media=media)
    logprobs: list[float] = []
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
            for row in out.prompt_logprobs or []:
                if row is not None:
                    logprobs.append(row.logprob)
    return logprobs, tokens


def test_the_step_budget_changes_nothing(tiny_gemma4: Any) -> None:
    runs = []
    for budget in (8, 512):
        served = served_with(tiny_gemma4[0], max_num_batched_tokens=budget)
        try:
            runs.append(run(served, f"budget-{budget}"))
        finally:
            served.shutdown()
    (chunked, tokens), (whole, expected) = runs
    assert len(chunked) == len(whole) > 300
    assert chunked == pytest.approx(whole, abs=1e-4)
    assert tokens == expected and len(tokens) == 4


def test_in_bf16_the_encoders_run_dense_as_the_prompt_rows_do(tiny_gemma4: Any) -> None:
    """The default dtype and kernels: encoder rows are prompt rows and run through the dense
    weight, as the decoder's prompt rows do, not through the int8 copies that serve small
    decode batches (whose int8 activations would cost the media some accuracy, and whose
    use would depend on how many rows were encoded together). So the prompt's
    log-probabilities are the same bits as with the packed copies switched off."""
    runs = []
    for packed in (True, False):
        served = served_with(
            tiny_gemma4[0], dtype="bf16", packed_kernels=packed, max_num_batched_tokens=4096
        )
        try:
            runs.append(run(served, f"packed-{packed}")[0])
        finally:
            served.shutdown()
    assert len(runs[0]) > 300
    assert runs[0] == runs[1]


def test_media_that_do_not_fit_their_placeholders_are_refused(tiny_gemma4: Any) -> None:
    served = served_with(tiny_gemma4[0])
    try:
        ids, media = prompt(served)
        assert [m.modality for m in media] == ["image", "audio", *["video"] * 4]
        image, clip = media[0], media[1]
        assert image.places is not None
        assert all(len(m.positions) == 63 for m in media[2:])  # 32x24 px frames: 72x56 kept
        bad = {
            "outside the position table": replace(image, places=image.places + 1000),
            "with their places": replace(image, places=None),
            "does not fill": replace(
                image, pixel_values=image.pixel_values[:-4], places=image.places[:-4]
            ),
            "rows, not": replace(clip, pixel_values=clip.pixel_values[:-8], frames=clip.frames - 8),
            "must be \\[frames": replace(clip, frames=clip.frames + 1),
        }
        for message, medium in bad.items():
            swapped = [medium, *media[1:]] if medium.modality == "image" else media[:]
            if medium.modality == "audio":
                swapped[1] = medium
            with pytest.raises(AdmissionError, match=message):
                served.engine.engine.add_request(
                    "bad", ids, SamplingParams(max_tokens=1), media=swapped
                )
        assert not served.engine.engine.has_unfinished()
    finally:
        served.shutdown()
