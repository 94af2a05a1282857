"""The engine on the tiny random Qwen2-Audio checkpoint: greedy output equal to transformers'
generate with audio (one clip, two clips, text alone, a 44.1 kHz stereo clip resampled),
chunked prefill through a clip, the encoder cache (a repeated clip is encoded once), the prefix
cache keyed by audio digests, and chat with audio parts."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.llm_engine import AdmissionError, LLMEngine
from inferd.engine.request import MediaInput
from inferd.engine.sampling import SamplingParams
from inferd.media.types import DecodedAudio
from inferd.models.qwen2_audio import Qwen2AudioForCausalLM
from inferd.serving.multimodal import MediaPromptError
from inferd.serving.served import ServedModel, load_model
from tests.models.test_whisper_features import noise, tone

CHUNK = 24  # tokens per step: a 1.3 s clip (32 placeholders) spans several steps
NEW = 8
RATE = 16000
AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"


@pytest.fixture(scope="module")
def served(tiny_qwen2_audio: tuple[Path, Any, Any]) -> Iterator[ServedModel]:
    cfg = EngineConfig(
        dtype="f32", max_num_batched_tokens=CHUNK, kv_cache_tokens=2048, max_model_len=1024
    )
    model = load_model(tiny_qwen2_audio[0], cfg, progress=False, loop=CallerLoop())
    yield model
    model.shutdown()


def clip(samples: np.ndarray, rate: int = RATE) -> DecodedAudio:
    samples = samples if samples.ndim == 2 else samples[None]
    digest = hashlib.sha256(samples.tobytes() + str(rate).encode()).hexdigest()
    return DecodedAudio(np.ascontiguousarray(samples, dtype=np.float32), rate, digest, "WAV")


def run(engine: LLMEngine, rid: str, ids: list[int], media: list[MediaInput]) -> list[int]:
    engine.add_request(rid, ids, SamplingParams(max_tokens=NEW, temperature=0), media=media)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
    return tokens


def reference(processor: Any, hf: Any, text: str, clips: list[DecodedAudio]) -> list[int]:
    """transformers on the same 16 kHz mono samples (resampling is DecodedAudio's)."""
    audio = [c.resampled(RATE).mono() for c in clips] or None
    inputs = processor(text=[text], audio=audio, sampling_rate=RATE, return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def encoder(served: ServedModel) -> Qwen2AudioForCausalLM:
    model = served.engine.engine.model
    assert isinstance(model, Qwen2AudioForCausalLM)
    return model


BEEP = clip(tone(1.3, 440.0))
HISS = clip(noise(0.5, 3))
STEREO = clip(np.stack([tone(0.9, 523.0, 44100), noise(0.9, 4, 44100)]), 44100)


@pytest.mark.parametrize(
    ("text", "clips"),
    [
        (f"<|im_start|>user\nAudio 1: {AUDIO}\nWhat is this sound?<|im_end|>\n", [BEEP]),
        (f"Audio 1: {AUDIO}\nAudio 2: {AUDIO}\nWhich is louder?", [HISS, BEEP]),
        (f"Audio 1: {AUDIO} at 44.1 kHz, two channels.", [STEREO]),
        ("The quick brown fox jumps over the lazy dog.", []),
    ],
    ids=["one clip", "two clips", "resampled stereo", "text only"],
)
def test_greedy_equals_transformers_generate(
    served: ServedModel, tiny_qwen2_audio: Any, text: str, clips: list[DecodedAudio]
) -> None:
    _, hf, processor = tiny_qwen2_audio
    ids, media = served.prompt(text, clips)
    audio = [c.resampled(RATE).mono() for c in clips] or None
    assert ids == processor(text=[text], audio=audio, sampling_rate=RATE)["input_ids"][0]
    assert len(ids) > CHUNK or not clips  # the prefill runs in chunks that cut a clip
    assert all(m.modality == "audio" for m in media) and len(media) == len(clips)
    tokens = run(served.engine.engine, f"greedy-{len(ids)}", ids, media)
    assert tokens == reference(processor, hf, text, clips)


def test_a_repeated_clip_is_encoded_once(served: ServedModel) -> None:
    model, engine = encoder(served), served.engine.engine
    sound = clip(tone(0.8, 1000.0))
    before = model.encoder_calls
    for n, question in enumerate([f"{AUDIO}Where?", f"{AUDIO}And now, when?"]):
        ids, media = served.prompt(question, [sound])
        run(engine, f"repeat-{n}", ids, media)
    assert model.encoder_calls - before == 1  # over several chunks and two requests
    ids, media = served.prompt(f"{AUDIO}Where?", [clip(tone(0.8, 1001.0))])
    run(engine, "repeat-other", ids, media)
    assert model.encoder_calls - before == 2


def test_prefix_cache_keys_blocks_by_audio(served: ServedModel, tiny_qwen2_audio: Any) -> None:
    _, hf, processor = tiny_qwen2_audio
    engine = served.engine.engine
    text = f"Audio 1: {AUDIO}\nDescribe the sound in one word, then another one."
    first, second = clip(tone(1.0, 300.0)), clip(tone(1.0, 600.0))  # same length, same ids

    def ask(rid: str, sound: DecodedAudio) -> tuple[list[int], list[int], int]:
        hits = engine.stats().prefix_cache_hits
        ids, media = served.prompt(text, [sound])
        tokens = run(engine, rid, ids, media)
        return ids, tokens, engine.stats().prefix_cache_hits - hits

    ids_a, a, hits_a = ask("prefix-a", first)
    ids_b, b, hits_b = ask("prefix-b", second)  # the same tokens, other audio
    _, c, hits_c = ask("prefix-c", first)  # the same tokens and audio
    assert ids_a == ids_b
    assert hits_a == hits_b == 0
    assert hits_c > 0
    assert b == reference(processor, hf, text, [second])
    assert a == c == reference(processor, hf, text, [first])
    assert a != b  # the audio reaches the output


def test_chat_with_audio_parts_matches_transformers(
    served: ServedModel, tiny_qwen2_audio: Any
) -> None:
    _, hf, processor = tiny_qwen2_audio
    messages = [
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A fox."},
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "And this?"}]},
    ]
    ids, media = served.chat_prompt(messages, [BEEP, HISS])
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    audio = [c.mono() for c in (BEEP, HISS)]
    assert ids == processor(text=[text], audio=audio, sampling_rate=RATE)["input_ids"][0]
    assert run(served.engine.engine, "chat", ids, media) == reference(
        processor, hf, text, [BEEP, HISS]
    )


def test_audio_must_sit_on_its_placeholders(served: ServedModel) -> None:
    engine = served.engine.engine
    ids, media = served.prompt(f"{AUDIO}Hi", [BEEP])
    m = media[0]
    shifted = MediaInput(
        m.digest, tuple(p + 1 for p in m.positions), m.pixel_values, None, "audio", m.frames
    )
    with pytest.raises(AdmissionError) as refused:
        engine.add_request("bad", ids, SamplingParams(max_tokens=1), media=[shifted])
    assert (refused.value.param, refused.value.code) == ("messages", "invalid_media")
    for frames in (m.frames + 8, 0):  # rows that would not fill the placeholders; no frames
        wrong = MediaInput(m.digest, m.positions, m.pixel_values, None, "audio", frames)
        with pytest.raises(AdmissionError, match="audio clip"):
            engine.add_request("frames", ids, SamplingParams(max_tokens=1), media=[wrong])
    cut = MediaInput(m.digest, m.positions, m.pixel_values[..., :100], None, "audio", m.frames)
    with pytest.raises(AdmissionError, match="features must be"):
        engine.add_request("cut", ids, SamplingParams(max_tokens=1), media=[cut])
    as_image = MediaInput(m.digest, m.positions, torch.zeros(1, 3, 32, 32))
    with pytest.raises(AdmissionError, match="take no images"):
        engine.add_request("img", ids, SamplingParams(max_tokens=1), media=[as_image])
    with pytest.raises(MediaPromptError):
        served.prompt(f"{AUDIO} and {AUDIO}", [BEEP])
    assert served.modalities["input"] == ["text", "audio"]


def test_a_text_model_refuses_audio(served_f32: ServedModel) -> None:
    ids = served_f32.chat_prompt([{"role": "user", "content": "Hi"}]).ids
    media = [MediaInput("d", (0,), torch.zeros(1, 32, 3000), modality="audio", frames=10)]
    with pytest.raises(AdmissionError, match="take no audio"):
        served_f32.engine.engine.add_request("aud", ids, SamplingParams(max_tokens=1), media=media)
    with pytest.raises(MediaPromptError, match="takes no audio"):
        served_f32.prompt(f"{AUDIO}Hi", [BEEP])
    assert served_f32.modalities["input"] == ["text"]


def test_an_audio_marker_typed_by_the_user_stays_text(served: ServedModel) -> None:
    typed = {"type": "text", "text": "Is <|AUDIO|> a tag?"}
    messages = [{"role": "user", "content": [{"type": "audio"}, typed]}]
    ids, media = served.chat_prompt(messages, [HISS])
    assert len(media) == 1
    placeholders = sum(1 for t in ids if t == encoder(served).audio_token_id)
    assert placeholders == len(media[0].positions)  # the typed one is plain text
    with pytest.raises(MediaPromptError):  # it is no audio slot either
        served.chat_prompt(messages, [HISS, BEEP])
    assert served.audio_sample_rate == RATE
