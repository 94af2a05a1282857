"""A tiny random Qwen2-Audio checkpoint, processor included, saved as transformers saves a real
one: ``config.json`` with ``audio_config``/``text_config``, ``model.safetensors`` under the real
tensor names, ``preprocessor_config.json`` (a WhisperFeatureExtractor: 30 s windows, hop 160,
n_fft 400) and a tokenizer holding the audio tokens (``<|audio_bos|>``, ``<|AUDIO|>``,
``<|audio_eos|>``).

The encoder keeps the real frame geometry (3000 mel frames -> 1500 positions -> 750 pooled rows
per 30 s window, so the processor's token counts are the real ones) with tiny widths; 32 mel bins
keep the mel filter bank meaningful at n_fft 400 while staying small.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from tests.models.tiny import byte_level_tokenizer, randomize

AUDIO_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
AUDIO_VOCAB = 330
MEL_BINS = 32
# The processor's default template's audio part, over content parts or a plain string.
AUDIO_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}{% set audio_count.value = audio_count.value + 1 %}"
    "{{ 'Audio ' + audio_count.value|string + ': <|audio_bos|><|AUDIO|><|audio_eos|>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def audio_tokenizer() -> Tokenizer:
    return byte_level_tokenizer(AUDIO_VOCAB, AUDIO_TOKENS)


def save_tiny_qwen2_audio(directory: Path, seed: int = 0) -> tuple[Any, Any]:
    """The randomized tiny model and its processor, saved in ``directory``; returns both
    (the model in float32 eval mode, eager attention)."""
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        Qwen2Config,
        WhisperFeatureExtractor,
    )

    fast = PreTrainedTokenizerFast(
        tokenizer_object=audio_tokenizer(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = AUDIO_TEMPLATE
    eos = fast.convert_tokens_to_ids("<|im_end|>")
    text = Qwen2Config(
        vocab_size=AUDIO_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=eos,
    )
    audio = dict(
        model_type="qwen2_audio_encoder",
        num_mel_bins=MEL_BINS,
        d_model=32,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=48,
        max_source_positions=1500,
    )
    config = Qwen2AudioConfig(
        audio_config=audio,
        text_config=text.to_dict(),
        audio_token_index=fast.convert_tokens_to_ids("<|AUDIO|>"),
    )
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config).float()
    randomize(model, seed)
    with torch.no_grad():  # audio rows on the scale of token rows, as in trained models
        model.model.multi_modal_projector.linear.weight.mul_(0.1)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.save_pretrained(str(directory))
    model.config._attn_implementation = "eager"
    model.config.audio_config._attn_implementation = "eager"
    extractor = WhisperFeatureExtractor(feature_size=MEL_BINS, return_attention_mask=True)
    processor = Qwen2AudioProcessor(
        feature_extractor=extractor, tokenizer=fast, chat_template=AUDIO_TEMPLATE
    )
    processor.save_pretrained(str(directory))
    return model.eval(), processor
