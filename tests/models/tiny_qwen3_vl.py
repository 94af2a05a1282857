"""A tiny random Qwen3-VL checkpoint, processor included, saved as transformers saves one:
``config.json`` (``vision_config`` with its deep-stack layers and learned position grid,
``text_config`` with interleaved M-RoPE sections), ``model.safetensors`` under the real tensor
names, the image processor's settings (Qwen3-VL's: a Qwen2-VL image processor with 16 px
patches, 2x2 merge, temporal patch of 2, mean and std of 0.5, small pixel bounds) and a
tokenizer holding the vision tokens; the video processor's settings are written by hand
(sampling 2 frames a second, 4 to 8 of them).

The encoder has three blocks, the first two feeding the deep stack (so decoder layers 0 and 1
both take rows), and a 4x4 position grid that every image's grid resamples (up or down).
The decoder's heads are 32 wide: 16 rotary pairs, interleaved over the three axes.

With ``moe``, the same model as Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``): layers
0 and 2 route each token to 2 of 4 experts (24 wide), layer 1 keeps a dense MLP
(``mlp_only_layers``).

With ``llama_cpp``, the checkpoint llama.cpp's converter takes as a published one
(``tiny_qwen3_vl_gguf`` converts it): the tokenizer splits text as Qwen2's does (the split
llama.cpp calls ``qwen2``), the processors have the published checkpoints' pixel bounds (which
the projector file does not record), the weights lie on Q8_0's grid (so its float32, float16
and Q8_0 files all hold this very model), and the MoE has experts in every layer, their stacks
saved as the published checkpoints hold them (transformers 4's layout: each expert's matrix
transposed); llama.cpp's ``qwen3vlmoe`` has no dense layer, and its converter reads the stacks
in that layout only (transformers 5's it splits wrongly, without an error).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.models.llama_cpp_convert import FileSpec, convert_files
from tests.models.tiny import byte_level_tokenizer, randomize
from tests.models.tiny_gemma4 import on_q8_0_grid
from tests.models.tiny_qwen_vl import (
    VISION_TOKENS,
    VL_TEMPLATE,
    VL_VOCAB,
    TinyProcessor,
    vl_tokenizer,
)

MIN_PIXELS = 64 * 64
MAX_PIXELS = 32 * 32 * 20  # at most 80 patches (20 tokens) an image
VIDEO_MIN_PIXELS = 64 * 64
VIDEO_MAX_PIXELS = 32 * 32 * 24  # over all frames: four frames of at most 6 groups each
SECTIONS = [6, 5, 5]
DEEPSTACK = [0, 1]
EXPERTS = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
)
# Qwen2's pre-tokenizer (its tokenizer.json's Split before the bytes), llama.cpp's ``qwen2``.
QWEN2_PRE_TOKENIZER = "qwen2"
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The published Qwen3-VL processors' pixel bounds: an image's, and a video's over all frames.
PUBLISHED_PIXELS = (65_536, 16_777_216)
PUBLISHED_VIDEO_PIXELS = (4_096, 25_165_824)


def save_tiny_qwen3_vl(
    directory: Path, seed: int = 0, moe: bool = False, *, llama_cpp: bool = False
) -> tuple[Any, TinyProcessor]:
    """The randomized tiny model (with ``moe``, Qwen3-VL-MoE's; with ``llama_cpp``, as
    llama.cpp's converter takes it) and its processor parts (images), saved in ``directory``;
    returns both (the model in float32 eval mode, eager attention)."""
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLImageProcessorPil,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    trained = (
        byte_level_tokenizer(VL_VOCAB, VISION_TOKENS, split=QWEN2_SPLIT)
        if llama_cpp
        else vl_tokenizer()
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=trained, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = VL_TEMPLATE
    ids = {t: fast.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    experts = EXPERTS | {"mlp_only_layers": []} if llama_cpp else EXPERTS
    text = dict(
        vocab_size=fast.vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": SECTIONS,
            "mrope_interleaved": True,
        },
        pad_token_id=0,
        **(experts if moe else {}),
    )
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        num_position_embeddings=16,
        deepstack_visual_indexes=DEEPSTACK,
    )
    config_class = Qwen3VLMoeConfig if moe else Qwen3VLConfig
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model_class = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
    model = model_class(config).float()
    randomize(model, seed)
    with torch.no_grad():  # vision rows on the scale of token rows, as in trained models
        visual = model.model.visual
        visual.patch_embed.proj.weight.mul_(0.1)
        for merger in [visual.merger, *visual.deepstack_merger_list]:
            merger.linear_fc2.weight.mul_(0.1)
    if llama_cpp:
        on_q8_0_grid(model)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.save_pretrained(str(directory))
    if llama_cpp and moe:
        _transpose_experts(directory / "model.safetensors")
    model.config._attn_implementation = "eager"
    model.config.vision_config._attn_implementation = "eager"
    model.config.text_config._attn_implementation = "eager"
    low, high = PUBLISHED_PIXELS if llama_cpp else (MIN_PIXELS, MAX_PIXELS)
    video_low, video_high = (
        PUBLISHED_VIDEO_PIXELS if llama_cpp else (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)
    )
    images = Qwen2VLImageProcessorPil(
        min_pixels=low,
        max_pixels=high,
        patch_size=16,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    images.save_pretrained(str(directory))
    fast.save_pretrained(str(directory))
    # transformers' video processor needs torchvision (not installed here): its settings are
    # written as it saves them, with small bounds (over all frames together).
    video = {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "size": {"shortest_edge": video_low, "longest_edge": video_high},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "resample": 3,
        "do_sample_frames": True,
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768 if llama_cpp else 8,  # the video processor's default, or few
    }
    (directory / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    return model.eval(), TinyProcessor(images, fast)


def _transpose_experts(checkpoint: Path) -> None:
    """The expert stacks rewritten as the published checkpoints hold them: [experts, in, out]
    (transformers 5 reads either, and saves [experts, out, in])."""
    tensors = load_file(checkpoint)
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = tensor.transpose(1, 2).contiguous()
    save_file(tensors, checkpoint, metadata={"format": "pt"})


# --- The same model as llama.cpp ships it: a language model GGUF plus a projector -------------

GGUF_FILES: tuple[FileSpec, ...] = (
    ("lm-f32", "f32", False),
    ("lm-f16", "f16", False),
    ("lm-q8_0", "q8_0", False),
    ("mmproj-f32", "f32", True),
    ("mmproj-f16", "f16", True),
)
MOE_GGUF_FILES: tuple[FileSpec, ...] = (
    ("lm-f16", "f16", False),
    ("lm-q8_0", "q8_0", False),
    ("mmproj-f32", "f32", True),
)


@dataclass(frozen=True)
class TinyQwen3VLGguf:
    """A ``llama_cpp`` checkpoint (its directory, transformers model and processor parts) and
    llama.cpp's files of it, by name (``GGUF_FILES``, ``MOE_GGUF_FILES``)."""

    directory: Path
    hf: Any
    processor: TinyProcessor
    files: dict[str, Path]

    @property
    def tiny(self) -> tuple[Path, Any, TinyProcessor]:
        """As the ``tiny_qwen3_vl`` fixture gives a checkpoint."""
        return self.directory, self.hf, self.processor


def tiny_qwen3_vl_gguf(directory: Path, out: Path, moe: bool = False) -> TinyQwen3VLGguf:
    """The ``llama_cpp`` checkpoint saved in ``directory`` and converted into ``out``."""
    hf, processor = save_tiny_qwen3_vl(directory, moe=moe, llama_cpp=True)
    files = MOE_GGUF_FILES if moe else GGUF_FILES
    converted = convert_files(directory, out, files, pre_tokenizer=QWEN2_PRE_TOKENIZER)
    return TinyQwen3VLGguf(directory, hf, processor, converted)
