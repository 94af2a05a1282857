"""A tiny random Gemma 3 vision checkpoint (Gemma3ForConditionalGeneration), processor
included, saved as transformers saves a real one: ``config.json`` with
``text_config``/``vision_config``, ``model.safetensors``, the processor's files, and a tokenizer
holding ``<start_of_image>``, ``<image_soft_token>``, ``<end_of_image>`` and the turn markers.

Dimensions keep the Gemma 3 logic meaningful: 64 px images in 8 px patches (an 8x8 grid)
pooled 2x2 to 16 soft tokens; a sliding window of 6, shorter than an image's 16 soft tokens, so
the bidirectional image mask and the window really meet; one sliding and one global layer,
rotating with their own bases (the global one scaled linearly).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from tests.models.tiny import SPECIALS, byte_level_tokenizer, randomize

IMAGE_SIZE = 64
PATCH = 8
MM_TOKENS = 16  # soft tokens per image: the 8x8 patch grid pooled 2x2
WINDOW = 6
BOI, SOFT, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
TURN_TOKENS = ["<start_of_turn>", "<end_of_turn>"]
EXTRA = [BOI, SOFT, EOI, *TURN_TOKENS]
VOCAB = 340
# Gemma's turns over content parts, an image part written as <start_of_image> (as the real
# template does); a message's parts are iterated, so string content must come as parts.
TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\\n' }}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def gemma3v_tokenizer() -> Tokenizer:
    return byte_level_tokenizer(VOCAB, EXTRA)


def token_id(name: str) -> int:
    return (SPECIALS + EXTRA).index(name)


def _tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=gemma3v_tokenizer(),
        eos_token="<end_of_turn>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": SOFT, "boi_token": BOI, "eoi_token": EOI},
    )
    fast.chat_template = TEMPLATE
    return fast


def _config() -> Any:
    from transformers import Gemma3Config, Gemma3TextConfig

    text = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,  # not head_dim: the scale is read, not assumed
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=512,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=token_id("<end_of_turn>"),
        tie_word_embeddings=False,
    )
    vision = dict(
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=3,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        vision_use_head=False,
    )
    return Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision,
        mm_tokens_per_image=MM_TOKENS,
        boi_token_index=token_id(BOI),
        eoi_token_index=token_id(EOI),
        image_token_index=token_id(SOFT),
        # Untied (real Gemma 3 ties them): with the random embedding as the head, each greedy
        # step repeats the token before it, and a reply of one repeated token tells little.
        tie_word_embeddings=False,
    )


def save_tiny_gemma3v(directory: Path, seed: int = 0) -> tuple[Any, Any]:
    """The randomized tiny model and its processor, saved in ``directory``; returns both
    (the model in float32 eval mode, eager attention)."""
    from transformers import (
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
    )

    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(_config()).float()
    randomize(model, seed)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.save_pretrained(str(directory))
    model.config._attn_implementation = "eager"
    images = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Gemma3Processor(
        image_processor=images,
        tokenizer=_tokenizer(),
        chat_template=TEMPLATE,
        image_seq_length=MM_TOKENS,
    )
    processor.save_pretrained(str(directory))
    return model.eval(), processor
