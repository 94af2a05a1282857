"""Our Qwen2-Audio against transformers on the tiny random checkpoint: the encoder's rows and
the logits of every position (f32), for one clip, two clips and text alone; the prompt's
``<|AUDIO|>`` expansion equal to the processor's ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from inferd.loading.hf_model import load_safetensors_model
from inferd.models.qwen2_audio import Qwen2AudioForCausalLM
from inferd.models.qwen2_audio_input import AUDIO_TOKEN, PreparedAudio, prepare_samples
from inferd.models.whisper_features import WhisperFeatureConfig
from tests.models.paged import paged_logits
from tests.models.test_whisper_features import noise, tone
from tests.models.tiny_audio import MEL_BINS

FEATURES = WhisperFeatureConfig(feature_size=MEL_BINS)


@pytest.fixture(scope="module")
def ours(tiny_qwen2_audio: tuple[Path, Any, Any]) -> Qwen2AudioForCausalLM:
    model, cfg = load_safetensors_model(tiny_qwen2_audio[0], torch.float32, progress=False)
    assert isinstance(model, Qwen2AudioForCausalLM)
    assert cfg.architecture == "qwen2_audio" and cfg.audio is not None
    return model


def our_embeddings(
    model: Qwen2AudioForCausalLM, ids: list[int], clips: list[PreparedAudio]
) -> torch.Tensor:
    with torch.inference_mode():
        x = model.embed(torch.tensor(ids)).clone()
        if clips:
            feats = torch.cat([c.features for c in clips])
            rows = model.encode_audio(feats, [c.frames for c in clips])
            x[torch.tensor(ids) == model.audio_token_id] = torch.cat(rows)
    return x


def expand(text: str, clips: list[PreparedAudio]) -> str:
    pieces = text.split(AUDIO_TOKEN)
    return pieces[0] + "".join(
        c.prompt_text() + rest for c, rest in zip(clips, pieces[1:], strict=True)
    )


AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"
CASES = {
    "one clip": (f"<|im_start|>user\nAudio 1: {AUDIO}\nWhat is this sound?", [tone(1.3, 440.0)]),
    "two clips": (
        f"Audio 1: {AUDIO}\nAudio 2: {AUDIO}\nWhich fox is quick?",
        [noise(0.7, 1), tone(2.2, 880.0) + noise(2.2, 2) * 0.1],
    ),
    "text only": ("The quick brown fox jumps over the lazy dog.", []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(
    case: str, ours: Qwen2AudioForCausalLM, tiny_qwen2_audio: tuple[Path, Any, Any]
) -> None:
    _, hf, processor = tiny_qwen2_audio
    text, clips = CASES[case]
    ref_inputs = processor(
        text=[text], audio=clips or None, sampling_rate=16000, return_tensors="pt"
    )
    with torch.inference_mode():
        ref = hf(**ref_inputs).logits[0]
    prepared = [prepare_samples(c, FEATURES) for c in clips]
    ids = processor.tokenizer(expand(text, prepared))["input_ids"]
    assert ids == ref_inputs["input_ids"][0].tolist()
    logits = paged_logits(ours, ids, our_embeddings(ours, ids, prepared))
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    if clips:  # the audio really reaches the logits: other sound changes them
        others = [prepare_samples(np.flip(c).copy(), FEATURES) for c in clips]
        moved = paged_logits(ours, ids, our_embeddings(ours, ids, others))
        assert (moved - logits).abs().max() > 1e-2


def test_encoder_matches_transformers(
    ours: Qwen2AudioForCausalLM, tiny_qwen2_audio: tuple[Path, Any, Any]
) -> None:
    """Two clips of different lengths in one call: each keeps its own rows, equal to the
    projector's output inside transformers' forward (the shorter clip's padding masked)."""
    _, hf, processor = tiny_qwen2_audio
    clips = [tone(3.0, 300.0), noise(0.4, 7)]
    full = processor(
        text=[f"a {AUDIO} b {AUDIO}"], audio=clips, sampling_rate=16000, return_tensors="pt"
    )
    captured: list[torch.Tensor] = []
    hook = hf.model.multi_modal_projector.register_forward_hook(
        lambda _m, _i, out: captured.append(out)
    )
    try:
        with torch.inference_mode():
            hf(**full)
    finally:
        hook.remove()
    prepared = [prepare_samples(c, FEATURES) for c in clips]
    feats = torch.cat([p.features for p in prepared])
    torch.testing.assert_close(feats, full["input_features"], atol=2e-5, rtol=0)
    with torch.inference_mode():
        mine = ours.encode_audio(full["input_features"], [p.frames for p in prepared])
    for i, (rows, p) in enumerate(zip(mine, prepared, strict=True)):
        assert rows.shape == (p.num_embeddings, ours.config.hidden_size)
        torch.testing.assert_close(rows, captured[0][i, : p.num_embeddings], atol=1e-5, rtol=1e-5)


# Qwen/Qwen2-Audio-7B's config.json: the text model's width and depth left to the defaults.
PUBLISHED_CONFIG = {
    "architectures": ["Qwen2AudioForConditionalGeneration"],
    "model_type": "qwen2_audio",
    "audio_token_index": 151646,
    "audio_config": {
        "model_type": "qwen2_audio_encoder",
        "num_mel_bins": 128,
        "encoder_layers": 32,
        "encoder_attention_heads": 20,
        "encoder_ffn_dim": 5120,
        "d_model": 1280,
        "activation_function": "gelu",
        "scale_embedding": False,
        "max_source_positions": 1500,
    },
    "text_config": {
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "intermediate_size": 11008,
        "max_position_embeddings": 8192,
        "model_type": "qwen2",
        "rope_theta": 10000,
        "rms_norm_eps": 1e-5,
        "sliding_window": 32768,
        "use_mrope": False,
        "vocab_size": 156032,
    },
}


def test_sparse_published_config_reads_as_transformers_reads_it() -> None:
    from transformers import Qwen2AudioConfig

    from inferd.models.config import config_from_hf

    ref = Qwen2AudioConfig(**{k: v for k, v in PUBLISHED_CONFIG.items() if k != "architectures"})
    cfg = config_from_hf(PUBLISHED_CONFIG, has_lm_head=True)
    text, audio = ref.text_config, ref.audio_config
    assert cfg.audio is not None and cfg.attention_bias and cfg.sliding_window is None
    assert (
        cfg.hidden_size,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.intermediate_size,
        cfg.vocab_size,
        cfg.rms_norm_eps,
    ) == (
        text.hidden_size,
        text.num_hidden_layers,
        text.num_attention_heads,
        text.num_key_value_heads,
        text.intermediate_size,
        text.vocab_size,
        text.rms_norm_eps,
    )
    assert (
        cfg.audio.hidden_size,
        cfg.audio.num_layers,
        cfg.audio.num_heads,
        cfg.audio.intermediate_size,
        cfg.audio.num_mel_bins,
        cfg.audio.max_frames,
        cfg.audio.audio_token_id,
    ) == (
        audio.d_model,
        audio.encoder_layers,
        audio.encoder_attention_heads,
        audio.encoder_ffn_dim,
        audio.num_mel_bins,
        3000,
        ref.audio_token_index,
    )
