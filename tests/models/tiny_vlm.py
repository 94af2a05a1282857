"""A tiny random Idefics3 (SmolVLM) checkpoint, processor included, saved as transformers saves
a real one: ``config.json`` with ``text_config``/``vision_config``, ``model.safetensors`` under
the real tensor names, ``preprocessor_config.json`` + ``processor_config.json``, and a tokenizer
that holds the image tokens (``<image>``, ``<fake_token_around_image>``, ``<global-img>``,
``<row_i_col_j>``).

Dimensions keep the processor's logic meaningful: tiles of 32 px (``max_image_size``), images
resized to at most 96 px on the long side (``size``), so a big image splits into up to 3x3
tiles plus the global one; patches of 8 px and a pixel shuffle of 2 give 4 tokens per tile.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from tests.models.tiny import SPECIALS, byte_level_tokenizer, randomize

TILE = 32  # max_image_size.longest_edge == vision image_size
LONGEST = 96  # size.longest_edge: at most 3x3 tiles
PATCH = 8
SCALE = 2
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE**2  # 4 tokens per tile
IMAGE_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]
VLM_VOCAB = 360
# SmolVLM2's video settings as its published preprocessor_config.json holds them (smaller):
# two frames a second, at most six, each resized to 48 px on the long side, then one tile.
VIDEO_SAMPLING = {"fps": 2, "max_frames": 6, "video_size": {"longest_edge": 48}}
# ChatML over content parts only, an image part written as <image>: like SmolVLM's templates,
# it iterates each message's parts, so a plain string content would render as nothing.
VLM_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'video' %}{{ '<video>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def vlm_tokenizer() -> Tokenizer:
    return byte_level_tokenizer(VLM_VOCAB, IMAGE_TOKENS)


def _tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=vlm_tokenizer(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<image>"},
    )
    fast.chat_template = VLM_TEMPLATE
    return fast


def _configs(eos: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The text config, the vision config and the top-level keys, both families alike."""
    import transformers

    text = transformers.LlamaConfig(
        vocab_size=VLM_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=eos,
    )
    vision = dict(
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=3,
        image_size=TILE,
        patch_size=PATCH,
        layer_norm_eps=1e-6,
    )
    top = dict(
        scale_factor=SCALE,
        image_token_id=IMAGE_TOKENS.index("<image>") + len(SPECIALS),
        tie_word_embeddings=False,
    )
    return text.to_dict(), vision, top


def _randomize_and_save(model: Any, directory: Path, seed: int) -> Any:
    randomize(model, seed)
    with torch.no_grad():  # image rows on the scale of token rows, as in trained models: 30x
        # larger they make attention so peaky that f32 rounding (1e-6) grows to 3e-4 in logits
        model.model.connector.modality_projection.proj.weight.mul_(0.1)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.save_pretrained(str(directory))
    model.config._attn_implementation = "eager"
    return model.eval()


def save_tiny_idefics3(directory: Path, seed: int = 0) -> tuple[Any, Any]:
    """The randomized tiny model and its processor, saved in ``directory``; returns both
    (the model in float32 eval mode, eager attention)."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    fast = _tokenizer()
    text, vision, top = _configs(fast.convert_tokens_to_ids("<|im_end|>"))
    config = Idefics3Config(text_config=text, vision_config=vision, **top)
    torch.manual_seed(seed)
    model = _randomize_and_save(Idefics3ForConditionalGeneration(config).float(), directory, seed)
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": LONGEST}, max_image_size={"longest_edge": TILE}
    )
    processor = Idefics3Processor(
        image_processor=images,
        tokenizer=fast,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=VLM_TEMPLATE,
    )
    processor.save_pretrained(str(directory))
    return model, processor


def save_tiny_smolvlm(directory: Path, seed: int = 1) -> tuple[Any, Any, Any]:
    """A tiny SmolVLM (SmolVLM2's ``smolvlm`` model type) in ``directory``, laid out as the
    published checkpoints are: ``preprocessor_config.json`` for the images and
    ``processor_config.json`` with ``image_seq_len``. transformers' SmolVLMProcessor needs
    torchvision (for video), so the files are written by its parts; returns the model, the
    tokenizer and the image processor."""
    from transformers import (
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMImageProcessorPil,
    )

    fast = _tokenizer()
    text, vision, top = _configs(fast.convert_tokens_to_ids("<|im_end|>"))
    config = SmolVLMConfig(text_config=text, vision_config=vision, **top)
    torch.manual_seed(seed)
    model = _randomize_and_save(SmolVLMForConditionalGeneration(config).float(), directory, seed)
    images = SmolVLMImageProcessorPil(
        size={"longest_edge": LONGEST}, max_image_size={"longest_edge": TILE}
    )
    images.save_pretrained(str(directory))
    settings = directory / "preprocessor_config.json"
    saved = json.loads(settings.read_text())
    settings.write_text(json.dumps({**saved, "video_sampling": VIDEO_SAMPLING}, indent=2))
    fast.save_pretrained(str(directory))
    processor = {"image_seq_len": IMAGE_SEQ_LEN, "processor_class": "SmolVLMProcessor"}
    (directory / "processor_config.json").write_text(json.dumps(processor))
    return model, fast, images
