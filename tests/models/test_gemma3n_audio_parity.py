"""Gemma 3n with audio (models/gemma3n_audio.py, gemma3n_audio_features.py,
gemma3n_multimodal.py) against transformers' Gemma3nForConditionalGeneration and
Gemma3nProcessor, on the tiny random checkpoint of tests/models/tiny_gemma3n.py (a clipping
bound and a logit cap that bend some values; its image encoder stubbed, as transformers builds
it with timm).

Features bit-equal to Gemma3nAudioFeatureExtractor's for clips of several lengths (one frame,
one past the 30 s cut) and, at the real 128 bins, with per-bin standardization; the settings
read back from the checkpoint; the encoder's rows equal transformers' for two attention shapes
(the tiny checkpoint's, and chunks unlike the context with keys ahead); a chat with a clip
gives the processor's ids (its fixed 188 audio tokens between blank lines), and float32 logits
and greedy tokens equal to transformers'; the engine admits a clip's features only as the model
can encode them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.llm_engine import AdmissionError
from inferd.engine.request import MediaInput
from inferd.engine.sampling import SamplingParams
from inferd.loading.hf_model import load_safetensors_model, load_tokenizer
from inferd.loading.hf_processor import read_gemma3n_audio_config
from inferd.media.types import DecodedAudio
from inferd.models.config import config_from_hf
from inferd.models.gemma3n_audio import Gemma3nAudioEncoder
from inferd.models.gemma3n_audio_features import Gemma3nAudioFeatureConfig
from inferd.models.gemma3n_multimodal import Gemma3nMultimodalForCausalLM
from inferd.serving.multimodal import AudioPrompter, MediaPromptError
from inferd.serving.served import load_model
from tests.models.paged import paged_logits
from tests.models.test_gemma4_audio_parity import noisy_tone
from tests.models.tiny_gemma3n import (
    AUDIO,
    AUDIO_SOFT_TOKENS,
    BOA,
    EOA,
    MEL_BINS,
    audio_config,
    mm_token_id,
    randomize_gemma3n,
    text_config,
)

LOGIT_TOLERANCE = 1e-3  # float32 on both sides over 200+ tokens: only summation order differs
ROW_TOLERANCE = 1e-4
LENGTHS = [600, 16_000 + 1234, 48_123, 480_000 + 5_000]  # samples at 16 kHz
FEATURES = Gemma3nAudioFeatureConfig(AUDIO, BOA, EOA, feature_size=MEL_BINS)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},  # chunks of 4 frames seeing 4 back
    "ahead": dict(
        conf_attention_chunk_size=3, conf_attention_context_left=6, conf_attention_context_right=2
    ),
}
MESSAGES: list[dict[str, Any]] = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Hear this:"},
            {"type": "audio"},
            {"type": "text", "text": "then say what it was."},
        ],
    }
]
Tiny = tuple[Path, Any, Any]


@pytest.fixture(scope="module")
def ours(tiny_gemma3n_audio: Tiny) -> Gemma3nMultimodalForCausalLM:
    model, _ = load_safetensors_model(tiny_gemma3n_audio[0], torch.float32, progress=False)
    assert isinstance(model, Gemma3nMultimodalForCausalLM)
    return model


def test_extractor_settings_are_read(
    tiny_gemma3n_audio: Tiny, ours: Gemma3nMultimodalForCausalLM
) -> None:
    """The extractor's settings, the media tokens and the processor's audio_seq_length, as the
    checkpoint saves them."""
    found = read_gemma3n_audio_config(tiny_gemma3n_audio[0], ours.config)
    assert found == FEATURES and found.soft_tokens == AUDIO_SOFT_TOKENS


def test_settings_are_read_as_transformers_v4_saved_them(
    tiny_gemma3n_audio: Tiny, ours: Gemma3nMultimodalForCausalLM, tmp_path: Path
) -> None:
    """transformers v4's layout (the published checkpoints'): the extractor's settings and
    audio_seq_length in a flat preprocessor_config.json, the media tokens under the
    tokenizer's ``extra_special_tokens``."""
    directory = tiny_gemma3n_audio[0]
    processor = json.loads((directory / "processor_config.json").read_text())
    flat = {**processor["feature_extractor"], "audio_seq_length": processor["audio_seq_length"]}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(flat))
    tokenizer = json.loads((directory / "tokenizer_config.json").read_text())
    names = ("audio_token", "boa_token", "eoa_token")
    tokenizer["extra_special_tokens"] = {n: tokenizer.pop(n) for n in names}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    assert read_gemma3n_audio_config(tmp_path, ours.config) == FEATURES


@pytest.mark.parametrize("samples", LENGTHS)
def test_features_are_bit_equal(samples: int) -> None:
    from transformers import Gemma3nAudioFeatureExtractor

    wave = noisy_tone(samples, seed=samples)
    expected = Gemma3nAudioFeatureExtractor(feature_size=MEL_BINS)([wave], return_tensors="np")
    ours = FEATURES.log_mel(wave)
    assert bool(expected["input_features_mask"].all())  # a lone clip has no padded frames
    assert ours.shape == (FEATURES.num_frames(samples), MEL_BINS)
    assert np.array_equal(expected["input_features"][0], ours)


def test_per_bin_features_at_the_real_width_are_bit_equal() -> None:
    from transformers import Gemma3nAudioFeatureExtractor

    mean = np.linspace(-2.0, 1.0, 128)
    std = np.linspace(0.5, 2.0, 128)
    settings = dict(per_bin_mean=mean.tolist(), per_bin_stddev=std.tolist(), mel_floor=1e-3)
    wave = noisy_tone(20_000, seed=5)
    extractor = Gemma3nAudioFeatureExtractor(**settings)
    expected = extractor([wave], return_tensors="np")
    # as transformers saves them: [1, 1, bins] nested lists
    saved = json.loads(extractor.to_json_string())
    cfg = Gemma3nAudioFeatureConfig.from_hf(saved, (AUDIO, BOA, EOA), AUDIO_SOFT_TOKENS)
    assert np.array_equal(expected["input_features"][0], cfg.log_mel(wave))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_encoder_rows_match_transformers(shape: str) -> None:
    """Our encoder with transformers' weights (the same module names) gives its rows."""
    from transformers import Gemma3nAudioConfig
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nAudioEncoder as Theirs

    settings = audio_config(**SHAPES[shape])
    torch.manual_seed(1)
    theirs = Theirs(Gemma3nAudioConfig(**settings)).float().eval()
    randomize_gemma3n(theirs, seed=1)
    whole = {"model_type": "gemma3n", "text_config": text_config().to_dict()}
    cfg = config_from_hf({**whole, "audio_config": settings}).gemma3n_audio
    assert cfg is not None
    ours = Gemma3nAudioEncoder(cfg)
    ours.load_state_dict(theirs.state_dict())
    wave = noisy_tone(16_000 + 1234, seed=1)
    features = torch.from_numpy(FEATURES.log_mel(wave))
    with torch.no_grad():
        out = theirs(features[None], torch.zeros(1, features.shape[0], dtype=torch.bool))
        rows = ours(features)
    assert rows.shape[0] == cfg.num_rows(features.shape[0]) == out.last_hidden_state.shape[1]
    assert (rows - out.last_hidden_state[0]).abs().max() < ROW_TOLERANCE


def _case(tiny: Tiny, ours: Gemma3nMultimodalForCausalLM, seed: int) -> tuple[Any, ...]:
    """The chat's ids as the server prepares them, the processor's inputs, the clip's
    features and its audio tokens' positions."""
    directory, _, processor = tiny
    wave = noisy_tone(12_000 + 777 * seed, seed=seed)
    text = processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], audio=[wave], return_tensors="pt")
    features = read_gemma3n_audio_config(directory, ours.config)
    assert features is not None
    prompter = AudioPrompter(features, load_tokenizer(directory, ours.config), AUDIO_ID)
    clip = DecodedAudio(wave[None], 16_000, f"clip-{seed}", "WAV")
    ids, media = prompter.prepare(text, [clip], add_special=False)
    return ids, inputs, media[0].pixel_values, media[0].positions


AUDIO_ID = mm_token_id(AUDIO)


def _forward(
    model: Gemma3nMultimodalForCausalLM,
    ids: list[int],
    clip: torch.Tensor,
    positions: tuple[int, ...],
) -> torch.Tensor:
    """Logits of one prompt in one prefill, the clip's rows over its audio tokens."""
    with torch.inference_mode():
        embeds = model.embed(torch.tensor(ids))
        embeds[list(positions)] = model.encode_clip(clip)
    return paged_logits(model, ids, embeds)


def test_audio_prompt_ids_and_logits_match_transformers(
    tiny_gemma3n_audio: Tiny, ours: Gemma3nMultimodalForCausalLM
) -> None:
    hf = tiny_gemma3n_audio[1]
    ids, inputs, clip, positions = _case(tiny_gemma3n_audio, ours, seed=2)
    assert ids == inputs["input_ids"][0].tolist()
    assert ids.count(AUDIO_ID) == len(positions) == AUDIO_SOFT_TOKENS
    with torch.no_grad():
        expected = hf(**inputs).logits[0]
    logits = _forward(ours, ids, clip, positions)
    assert (logits - expected).abs().max() < LOGIT_TOLERANCE
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_audio_greedy_tokens_match_transformers(
    tiny_gemma3n_audio: Tiny, ours: Gemma3nMultimodalForCausalLM
) -> None:
    hf = tiny_gemma3n_audio[1]
    ids, inputs, clip, positions = _case(tiny_gemma3n_audio, ours, seed=3)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=5, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    for _ in range(5):
        ids = [*ids, int(_forward(ours, ids, clip, positions)[-1].argmax())]
    assert ids[-5:] == expected


def test_the_engine_admits_only_clips_the_model_can_encode(tiny_gemma3n_audio: Tiny) -> None:
    """A clip's features must encode to no more rows than the model's audio tokens, at its
    mel bins, over all of them; a clip shorter than a frame is refused before."""
    cfg = EngineConfig(dtype="f32", kv_cache_tokens=512, max_model_len=512)
    served = load_model(tiny_gemma3n_audio[0], cfg, progress=False, loop=CallerLoop())
    try:
        assert served.modalities["input"] == ["text", "audio"]
        clip = DecodedAudio(noisy_tone(9_000, seed=4)[None], 16_000, "clip", "WAV")
        ids, media = served.prompt(f"Hear {AUDIO} now", [clip])
        m, engine = media[0], served.engine.engine
        assert len(m.positions) == AUDIO_SOFT_TOKENS
        engine.check_media(ids, media)
        frames = FEATURES.num_frames(FEATURES.max_samples) + 16  # one row past the model's
        features = m.pixel_values
        wrong = [
            (torch.zeros(frames, MEL_BINS), m.positions, frames),
            (features[:, :8], m.positions, m.frames),
            (features, m.positions[1:], m.frames),
        ]
        for values, positions, count in wrong:
            bad = MediaInput(m.digest, positions, values, modality="audio", frames=count)
            with pytest.raises(AdmissionError, match="audio clip"):
                engine.add_request("bad", ids, SamplingParams(max_tokens=1), media=[bad])
        short = DecodedAudio(np.zeros((1, 300), np.float32), 16_000, "short", "WAV")
        with pytest.raises(MediaPromptError, match="too short"):
            served.prompt(AUDIO, [short])
    finally:
        served.shutdown()
