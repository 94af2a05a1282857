"""Gemma 4 with audio (models/gemma4_audio.py, models/gemma4_audio_features.py) against
transformers' Gemma4ForConditionalGeneration and its processor, on the tiny random checkpoint
of tests/models/tiny_gemma4.py (clipped projections with finite bounds, soft-capped logits).

Features bit-equal to Gemma4AudioFeatureExtractor's valid frames for clips of several lengths
(one past the 30 s cut) and with pre-emphasis and per-bin standardization; the encoder's rows
equal transformers' for two attention shapes (the real one's chunk and context, and chunks
unlike the context with keys ahead); and a prompt with an audio clip and an image gives the
processor's ids, float32 logits and greedy tokens equal to transformers'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from inferd.loading.hf_model import load_safetensors_model
from inferd.loading.hf_processor import read_gemma4_audio_config
from inferd.models.config import Gemma4AudioConfig
from inferd.models.gemma4_audio_features import Gemma4AudioFeatureConfig
from inferd.models.gemma4_multimodal import Gemma4MultimodalForCausalLM
from tests.models.paged import paged_logits
from tests.models.test_gemma4_vision_parity import IMAGE_CONFIG, _image, _spans
from tests.models.tiny_gemma4 import (
    AUDIO,
    BOA,
    EOA,
    IMAGE,
    MEL_BINS,
    mm_token_id,
    save_tiny_gemma4,
)

LOGIT_TOLERANCE = 1e-3  # float32 on both sides over 100+ tokens: only summation order differs
ROW_TOLERANCE = 1e-4
LENGTHS = [400, 16_000 + 1234, 48_123, 480_000 + 5_000]  # samples at 16 kHz
SHAPES: dict[str, dict[str, Any]] = {
    "real": {},  # chunks of 4 frames seeing 4 back, itself included
    "ahead": dict(attention_chunk_size=3, attention_context_left=6, attention_context_right=2),
}
MESSAGES: list[dict[str, Any]] = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Hear "},
            {"type": "audio"},
            {"type": "text", "text": " and see "},
            {"type": "image"},
            {"type": "text", "text": " then say."},
        ],
    }
]


def noisy_tone(samples: int, seed: int) -> npt.NDArray[np.float32]:
    """An A (440 Hz) under seeded noise, at 16 kHz."""
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / 16_000
    tone = 0.4 * np.sin(2 * np.pi * 440 * t) + 0.1 * rng.standard_normal(samples)
    return tone.astype(np.float32)


FEATURES = Gemma4AudioFeatureConfig(AUDIO, BOA, EOA, feature_size=MEL_BINS)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Any, Any, Gemma4MultimodalForCausalLM]:
    directory: Path = tmp_path_factory.mktemp(f"gemma4_audio_{request.param}")
    hf, processor = save_tiny_gemma4(directory, audio_overrides=SHAPES[request.param])
    ours, _ = load_safetensors_model(directory, torch.float32, progress=False)
    assert isinstance(ours, Gemma4MultimodalForCausalLM)
    return str(directory), hf, processor, ours


def test_extractor_settings_are_read(
    checkpoint: tuple[str, Any, Any, Gemma4MultimodalForCausalLM],
) -> None:
    """The extractor's settings and media tokens as the checkpoint saves them."""
    directory, _, _, ours = checkpoint
    assert read_gemma4_audio_config(Path(directory), ours.config) == FEATURES


@pytest.mark.parametrize("samples", LENGTHS)
def test_features_are_bit_equal(samples: int) -> None:
    from transformers import Gemma4AudioFeatureExtractor

    wave = noisy_tone(samples, seed=samples)
    expected = Gemma4AudioFeatureExtractor(feature_size=MEL_BINS)([wave], return_tensors="np")
    valid = int(expected["input_features_mask"][0].sum())
    ours = FEATURES.log_mel(wave)
    assert ours.shape == (valid, MEL_BINS) and valid == FEATURES.num_frames(samples)
    assert np.array_equal(expected["input_features"][0, :valid], ours)


def test_preemphasis_and_per_bin_features_are_bit_equal() -> None:
    from transformers import Gemma4AudioFeatureExtractor

    mean = tuple(float(x) for x in np.linspace(-2.0, 1.0, MEL_BINS))
    std = tuple(float(x) for x in np.linspace(0.5, 2.0, MEL_BINS))
    settings = dict(preemphasis=0.97, per_bin_mean=mean, per_bin_stddev=std, mel_floor=1e-5)
    wave = noisy_tone(20_000, seed=5)
    extractor = Gemma4AudioFeatureExtractor(feature_size=MEL_BINS, **settings)
    expected = extractor([wave], return_tensors="np")
    cfg = Gemma4AudioFeatureConfig.from_hf(
        {"feature_size": MEL_BINS, **settings}, (AUDIO, BOA, EOA)
    )
    ours = cfg.log_mel(wave)
    assert np.array_equal(expected["input_features"][0, : ours.shape[0]], ours)


def test_encoder_rows_match_transformers(
    checkpoint: tuple[str, Any, Any, Gemma4MultimodalForCausalLM],
) -> None:
    _, hf, processor, ours = checkpoint
    wave = noisy_tone(16_000 + 1234, seed=1)
    inputs = processor.feature_extractor([wave], return_tensors="pt")
    with torch.no_grad():
        out = hf.model.get_audio_features(inputs["input_features"], inputs["input_features_mask"])
        expected = out.pooler_output[out.attention_mask]
        rows = ours.encode_clip(torch.from_numpy(FEATURES.log_mel(wave)))
    assert rows.shape[0] == Gemma4AudioConfig.num_tokens(FEATURES.num_frames(len(wave)))
    assert (rows - expected).abs().max() < ROW_TOLERANCE


def _prompt(processor: Any, samples: int, image: Any) -> tuple[list[int], str]:
    text = processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ours = text.replace(AUDIO, FEATURES.prompt_text(samples), 1)
    ours = ours.replace(IMAGE, image.prompt_text(), 1)
    return processor.tokenizer(ours, add_special_tokens=False)["input_ids"], text


def _forward(
    model: Gemma4MultimodalForCausalLM, ids: list[int], clip: torch.Tensor, image: Any
) -> torch.Tensor:
    """Logits of one prompt in one prefill: the clip's rows over its audio tokens, the image's
    over its image tokens (which see each other both ways)."""
    input_ids = torch.tensor(ids)
    with torch.inference_mode():
        embeds = model.embed(input_ids)
        embeds[input_ids == mm_token_id(AUDIO)] = model.encode_clip(clip)
        embeds[input_ids == mm_token_id(IMAGE)] = model.encode_patches(
            image.patches, image.positions
        )
    return paged_logits(model, ids, embeds, spans=_spans(ids, mm_token_id(IMAGE)))


def _case(processor: Any, seed: int) -> tuple[list[int], Any, torch.Tensor, Any]:
    wave = noisy_tone(12_000 + 777 * seed, seed=seed)
    picture = _image(20, 30, seed=seed)
    image = IMAGE_CONFIG.prepare(picture)
    ids, text = _prompt(processor, len(wave), image)
    inputs = processor(text=[text], images=[[picture]], audio=[wave], return_tensors="pt")
    return ids, inputs, torch.from_numpy(FEATURES.log_mel(wave)), image


def test_audio_and_image_prompt_logits_match_transformers(
    checkpoint: tuple[str, Any, Any, Gemma4MultimodalForCausalLM],
) -> None:
    _, hf, processor, ours = checkpoint
    ids, inputs, clip, image = _case(processor, seed=2)
    assert ids == inputs["input_ids"][0].tolist()
    assert ids.count(mm_token_id(AUDIO)) == FEATURES.num_tokens(12_000 + 777 * 2)
    with torch.no_grad():
        expected = hf(**inputs).logits[0]
    logits = _forward(ours, ids, clip, image)
    assert (logits - expected).abs().max() < LOGIT_TOLERANCE
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_audio_greedy_tokens_match_transformers(
    checkpoint: tuple[str, Any, Any, Gemma4MultimodalForCausalLM],
) -> None:
    _, hf, processor, ours = checkpoint
    ids, inputs, clip, image = _case(processor, seed=3)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=5, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    for _ in range(5):
        ids = [*ids, int(_forward(ours, ids, clip, image)[-1].argmax())]
    assert ids[-5:] == expected
