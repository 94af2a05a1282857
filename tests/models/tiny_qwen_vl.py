"""A tiny random Qwen2.5-VL checkpoint, processor included, saved as transformers saves a real
one: ``config.json`` (``vision_config``, ``text_config``, M-RoPE sections), ``model.safetensors``
under the real tensor names, the image processor's settings (a Qwen2-VL image processor: the
real 14 px patches, 2x2 merge and temporal patch of 2, with small pixel bounds) and a
tokenizer holding the vision tokens.

transformers' video processor needs torchvision, which the test environment does not install,
so the image processor and tokenizer are saved apart (as published checkpoints lay them out)
and ``video_preprocessor_config.json`` is written here
with the video processor's own keys (as transformers would save it), with small bounds too.

The encoder has two blocks, the second one full attention, and 56 px windows (2x2 merge
groups), so windowed and full attention both matter on images a few windows wide.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from tests.models.tiny import byte_level_tokenizer, randomize

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VL_VOCAB = 330
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 20  # at most 80 patches (20 tokens) an image
VIDEO_MIN_PIXELS = 56 * 56
VIDEO_MAX_PIXELS = 28 * 28 * 6  # at most 24 patches a frame
TOKENS_PER_SECOND = 2
# Qwen2.5-VL's template, cut to its media parts, over content parts or a plain string.
VL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyProcessor:
    image_processor: Any
    tokenizer: Any


def vl_tokenizer() -> Tokenizer:
    return byte_level_tokenizer(VL_VOCAB, VISION_TOKENS)


def save_tiny_qwen2_5_vl(directory: Path, seed: int = 0) -> tuple[Any, Any]:
    """The randomized tiny model and its processor (images), saved in ``directory``; returns
    both (the model in float32 eval mode, eager attention)."""
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    fast = PreTrainedTokenizerFast(
        tokenizer_object=vl_tokenizer(), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = VL_TEMPLATE
    ids = {t: fast.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(
        vocab_size=VL_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        temporal_patch_size=2,
        spatial_merge_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
        tokens_per_second=TOKENS_PER_SECOND,
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).float()
    randomize(model, seed)
    with torch.no_grad():  # vision rows on the scale of token rows, as in trained models
        model.model.visual.patch_embed.proj.weight.mul_(0.1)
        model.model.visual.merger.mlp[2].weight.mul_(0.1)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.save_pretrained(str(directory))
    model.config._attn_implementation = "eager"
    model.config.vision_config._attn_implementation = "eager"
    model.config.text_config._attn_implementation = "eager"
    images = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    # As published checkpoints lay it out: preprocessor_config.json, the tokenizer files and
    # the chat template (transformers' processor object needs a video processor to exist).
    images.save_pretrained(str(directory))
    fast.save_pretrained(str(directory))
    processor = TinyProcessor(images, fast)
    video = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "size": {"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": list(images.image_mean),
        "image_std": list(images.image_std),
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "resample": 3,
    }
    (directory / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    return model.eval(), processor
