"""The image processor settings of a Hugging Face multimodal directory: transformers v5 saves
them in ``processor_config.json`` (under ``image_processor``), earlier versions and most
published checkpoints in ``preprocessor_config.json``; ``image_seq_len`` sits in
``processor_config.json`` when given."""

from __future__ import annotations

from pathlib import Path

from inferd.loading.hf_tokenizer import read_json
from inferd.models.config import ModelConfig, ModelConfigError
from inferd.models.idefics3_image import Idefics3ImageConfig

PREPROCESSOR_CONFIG = "preprocessor_config.json"
PROCESSOR_CONFIG = "processor_config.json"


def read_image_config(directory: Path, cfg: ModelConfig) -> Idefics3ImageConfig | None:
    """How to prepare images for this model; None for a model without an image encoder."""
    vision = cfg.vision
    if vision is None:
        return None
    processor = read_json(directory / PROCESSOR_CONFIG)
    settings = read_json(directory / PREPROCESSOR_CONFIG) or processor.get("image_processor")
    if not isinstance(settings, dict) or not settings:
        raise ModelConfigError(f"{directory}: no image processor settings ({PREPROCESSOR_CONFIG})")
    seq_len = int(processor.get("image_seq_len") or vision.tokens_per_tile)
    image = Idefics3ImageConfig.from_hf(settings, seq_len)
    if image.image_seq_len != vision.tokens_per_tile or image.tile != vision.image_size:
        raise ModelConfigError(
            f"{directory}: the processor makes {image.tile} px tiles of {image.image_seq_len} "
            f"tokens, the encoder takes {vision.image_size} px tiles of "
            f"{vision.tokens_per_tile}"
        )
    return image
