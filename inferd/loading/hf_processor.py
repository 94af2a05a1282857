"""The image processor and audio feature extractor settings of a Hugging Face multimodal
directory: transformers v5 saves them in ``processor_config.json`` (under ``image_processor``
or ``feature_extractor``), earlier versions and most published checkpoints in
``preprocessor_config.json``; ``image_seq_len`` sits in ``processor_config.json`` when given."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from inferd.loading.hf_tokenizer import read_json
from inferd.models.config import ModelConfig, ModelConfigError
from inferd.models.gemma3_image import SOFT_TOKEN, Gemma3ImageConfig
from inferd.models.gemma3n_audio_features import Gemma3nAudioFeatureConfig
from inferd.models.gemma4_audio_features import Gemma4AudioFeatureConfig
from inferd.models.gemma4_image import Gemma4ImageConfig
from inferd.models.gemma4_video import Gemma4VideoConfig
from inferd.models.idefics3_image import Idefics3ImageConfig, ImageConfigError
from inferd.models.qwen2_vl_image import QwenVisualConfig
from inferd.models.qwen3_vl_video import Qwen3VideoConfig
from inferd.models.smolvlm_video import SmolVLMVideoConfig
from inferd.models.whisper_features import AudioFeatureError, WhisperFeatureConfig

PREPROCESSOR_CONFIG = "preprocessor_config.json"
PROCESSOR_CONFIG = "processor_config.json"
VIDEO_PREPROCESSOR_CONFIG = "video_preprocessor_config.json"
# transformers' Qwen2-VL processors' pixel bounds when the settings name none.
QWEN_IMAGE_PIXELS = (56 * 56, 28 * 28 * 1280)
QWEN_VIDEO_PIXELS = (128 * 28 * 28, 28 * 28 * 768)
VIDEO_ARCHITECTURES = frozenset({"smolvlm"})  # SmolVLM2 reads videos; Idefics3 does not


ImageConfig = Idefics3ImageConfig | Gemma3ImageConfig


def read_image_config(directory: Path, cfg: ModelConfig) -> ImageConfig | None:
    """How to prepare images for this model; None for a model without an image encoder."""
    vision = cfg.vision
    if vision is None and cfg.gemma3n_vision is None:
        return None
    processor = read_json(directory / PROCESSOR_CONFIG)
    settings = read_json(directory / PREPROCESSOR_CONFIG) or processor.get("image_processor")
    if not isinstance(settings, dict) or not settings:
        raise ModelConfigError(f"{directory}: no image processor settings ({PREPROCESSOR_CONFIG})")
    if vision is None:
        return _gemma3n_image_config(directory, settings, processor, cfg)
    if vision.pooled:
        return _gemma3_image_config(directory, settings, processor, cfg)
    seq_len = int(processor.get("image_seq_len") or vision.tokens_per_tile)
    image = Idefics3ImageConfig.from_hf(settings, seq_len)
    if image.image_seq_len != vision.tokens_per_tile or image.tile != vision.image_size:
        raise ModelConfigError(
            f"{directory}: the processor makes {image.tile} px tiles of {image.image_seq_len} "
            f"tokens, the encoder takes {vision.image_size} px tiles of "
            f"{vision.tokens_per_tile}"
        )
    return image


def _gemma3_image_config(
    directory: Path, settings: dict, processor: dict, cfg: ModelConfig
) -> Gemma3ImageConfig:
    """Gemma 3's: one square image of the encoder's size, ``image_seq_length`` soft tokens."""
    vision = cfg.vision
    assert vision is not None
    seq_len = int(processor.get("image_seq_length") or vision.tokens_per_tile)
    try:
        image = Gemma3ImageConfig.from_hf(settings, seq_len)
    except ImageConfigError as e:
        raise ModelConfigError(f"{directory}: {e}") from e
    side = vision.image_size
    if (image.height, image.width) != (side, side) or seq_len != vision.tokens_per_tile:
        raise ModelConfigError(
            f"{directory}: the processor makes {image.height}x{image.width} px images of "
            f"{seq_len} tokens, the encoder takes {side} px images of {vision.tokens_per_tile}"
        )
    return image


def _gemma3n_image_config(
    directory: Path, settings: dict, processor: dict, cfg: ModelConfig
) -> Gemma3ImageConfig:
    """Gemma 3n's: Gemma 3's one resized image, whose soft token the chat template writes
    (Gemma3nProcessor expands it as Gemma 3's processor expands ``<start_of_image>``); the
    encoder fuses any size to its grid, whose rows the processor's count must equal."""
    vision = cfg.gemma3n_vision
    assert vision is not None
    seq_len = int(processor.get("image_seq_length") or vision.soft_tokens)
    try:
        image = replace(Gemma3ImageConfig.from_hf(settings, seq_len), marker=SOFT_TOKEN)
    except ImageConfigError as e:
        raise ModelConfigError(f"{directory}: {e}") from e
    if seq_len != vision.soft_tokens:
        raise ModelConfigError(
            f"{directory}: the processor writes {seq_len} tokens per image, the encoder "
            f"makes {vision.soft_tokens}"
        )
    return image


def read_audio_config(directory: Path, cfg: ModelConfig) -> WhisperFeatureConfig | None:
    """How to featurize audio for this model; None for a model without an audio encoder."""
    audio = cfg.audio
    if audio is None:
        return None
    settings = read_json(directory / PREPROCESSOR_CONFIG) or read_json(
        directory / PROCESSOR_CONFIG
    ).get("feature_extractor")
    if not isinstance(settings, dict) or not settings:
        raise ModelConfigError(
            f"{directory}: no feature extractor settings ({PREPROCESSOR_CONFIG})"
        )
    try:
        features = WhisperFeatureConfig.from_hf(settings)
    except AudioFeatureError as e:
        raise ModelConfigError(f"{directory}: {e}") from e
    if features.feature_size != audio.num_mel_bins or features.max_frames != audio.max_frames:
        raise ModelConfigError(
            f"{directory}: the feature extractor makes {features.max_frames} frames of "
            f"{features.feature_size} mel bins, the encoder takes {audio.max_frames} of "
            f"{audio.num_mel_bins}"
        )
    return features


def read_visual_configs(
    directory: Path, cfg: ModelConfig
) -> tuple[QwenVisualConfig, QwenVisualConfig] | None:
    """How to prepare images and videos for a Qwen2.5-VL model; None for other models. The
    video settings: ``video_preprocessor_config.json``, else the processor's
    ``video_processor``, else the image settings (as transformers falls back to them)."""
    vision = cfg.qwen_vision
    if vision is None:
        return None
    processor = read_json(directory / PROCESSOR_CONFIG)
    image = read_json(directory / PREPROCESSOR_CONFIG) or processor.get("image_processor")
    if not isinstance(image, dict) or not image:
        raise ModelConfigError(f"{directory}: no image processor settings ({PREPROCESSOR_CONFIG})")
    video = read_json(directory / VIDEO_PREPROCESSOR_CONFIG) or processor.get("video_processor")
    if not isinstance(video, dict) or not video:
        video, video_pixels = image, QWEN_IMAGE_PIXELS
    else:
        video_pixels = QWEN_VIDEO_PIXELS
    try:
        configs = (
            QwenVisualConfig.from_hf(image, QWEN_IMAGE_PIXELS),
            QwenVisualConfig.from_hf(video, video_pixels),
        )
    except ImageConfigError as e:
        raise ModelConfigError(f"{directory}: {e}") from e
    for c in configs:
        shape = (c.patch_size, c.temporal_patch_size, c.merge_size)
        if shape != (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size):
            raise ModelConfigError(
                f"{directory}: the processor's patches (size, time, merge) {shape} are not "
                "the encoder's"
            )
    return configs


def read_video_config(
    directory: Path, cfg: ModelConfig, image: ImageConfig | None
) -> SmolVLMVideoConfig | None:
    """How to sample and prepare videos for this model; None for a model that takes none.
    SmolVLM2's settings: ``video_sampling`` in ``preprocessor_config.json`` (the published
    checkpoints), or transformers' saved video processor (``video_preprocessor_config.json``
    or ``processor_config.json``'s ``video_processor``)."""
    if cfg.architecture not in VIDEO_ARCHITECTURES or not isinstance(image, Idefics3ImageConfig):
        return None
    images = read_json(directory / PREPROCESSOR_CONFIG)
    settings = (
        read_json(directory / VIDEO_PREPROCESSOR_CONFIG)
        or read_json(directory / PROCESSOR_CONFIG).get("video_processor")
        or (images if images.get("video_sampling") else None)
    )
    if not isinstance(settings, dict) or not settings:
        return None  # a SmolVLM checkpoint without video settings takes images only
    try:
        return SmolVLMVideoConfig.from_hf(settings, image)
    except ImageConfigError as e:
        raise ModelConfigError(f"{directory}: {e}") from e


def read_qwen3_video_config(directory: Path, cfg: ModelConfig) -> Qwen3VideoConfig | None:
    """How a Qwen3-VL model's videos are sampled and prepared
    (``video_preprocessor_config.json``, else the processor's ``video_processor``); None for
    other models."""
    vision = cfg.qwen_vision
    if cfg.architecture != "qwen3_vl" or vision is None:
        return None
    processor = read_json(directory / PROCESSOR_CONFIG)
    video = read_json(directory / VIDEO_PREPROCESSOR_CONFIG) or processor.get("video_processor")
    try:
        config = Qwen3VideoConfig.from_hf(video if isinstance(video, dict) else {})
    except ImageConfigError as e:
        raise ModelConfigError(f"{directory}: {e}") from e
    v = config.visual
    shape = (v.patch_size, v.temporal_patch_size, v.merge_size)
    if shape != (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size):
        raise ModelConfigError(
            f"{directory}: the video processor's patches (size, time, merge) {shape} are not "
            "the encoder's"
        )
    return config


TOKENIZER_CONFIG = "tokenizer_config.json"


def _media_tokens(directory: Path, names: tuple[str, str, str]) -> tuple[str, str, str]:
    """The media tokens a Gemma tokenizer names (``image_token``, ``boi_token``, ...): at the
    top of its settings, or (as transformers v4 saved them) in ``extra_special_tokens``."""
    settings = read_json(directory / TOKENIZER_CONFIG)
    extra = settings.get("extra_special_tokens")
    extra = extra if isinstance(extra, dict) else {}
    tokens = tuple(settings.get(n) or extra.get(n) for n in names)
    if not all(isinstance(t, str) and t for t in tokens):
        raise ModelConfigError(f"{directory}: {TOKENIZER_CONFIG} does not name {', '.join(names)}")
    return tokens[0], tokens[1], tokens[2]  # type: ignore[return-value]


def read_gemma4_image_config(directory: Path, cfg: ModelConfig) -> Gemma4ImageConfig | None:
    """How to prepare images for a Gemma 4 model; None for a model without its encoder."""
    vision = cfg.gemma4_vision
    if vision is None:
        return None
    settings = read_json(directory / PROCESSOR_CONFIG).get("image_processor") or read_json(
        directory / PREPROCESSOR_CONFIG
    )
    if not isinstance(settings, dict) or not settings:
        raise ModelConfigError(f"{directory}: no image processor settings ({PROCESSOR_CONFIG})")
    tokens = _media_tokens(directory, ("image_token", "boi_token", "eoi_token"))
    try:
        image = Gemma4ImageConfig.from_hf(settings, tokens)
    except ImageConfigError as e:
        raise ModelConfigError(f"{directory}: {e}") from e
    if (image.patch_size, image.pooling) != (vision.patch_size, vision.pooling):
        raise ModelConfigError(
            f"{directory}: the processor's {image.patch_size} px patches pooled by "
            f"{image.pooling} are not the encoder's ({vision.patch_size}, {vision.pooling})"
        )
    return image


def read_gemma4_audio_config(directory: Path, cfg: ModelConfig) -> Gemma4AudioFeatureConfig | None:
    """How to featurize audio for a Gemma 4 model; None for a model without its encoder."""
    audio = cfg.gemma4_audio
    if audio is None:
        return None
    settings = read_json(directory / PROCESSOR_CONFIG).get("feature_extractor")
    if not isinstance(settings, dict) or not settings:
        raise ModelConfigError(f"{directory}: no feature extractor settings ({PROCESSOR_CONFIG})")
    tokens = _media_tokens(directory, ("audio_token", "boa_token", "eoa_token"))
    try:
        features = Gemma4AudioFeatureConfig.from_hf(settings, tokens)
    except AudioFeatureError as e:
        raise ModelConfigError(f"{directory}: {e}") from e
    if features.feature_size != audio.conv_channels[0]:
        raise ModelConfigError(
            f"{directory}: the feature extractor makes {features.feature_size} mel bins, the "
            f"encoder takes {audio.conv_channels[0]}"
        )
    return features


def read_gemma3n_audio_config(
    directory: Path, cfg: ModelConfig
) -> Gemma3nAudioFeatureConfig | None:
    """How to featurize audio for a Gemma 3n model (the processor's ``feature_extractor``
    settings, else ``preprocessor_config.json``'s, where published checkpoints keep them beside
    the image processor's); None for a model without its audio encoder. The processor's
    ``audio_seq_length`` (tokens a clip stands for) must be the model's, and the longest clip
    must encode to no more rows."""
    audio = cfg.gemma3n_audio
    if audio is None:
        return None
    processor = read_json(directory / PROCESSOR_CONFIG)
    preprocessor = read_json(directory / PREPROCESSOR_CONFIG)
    settings = processor.get("feature_extractor") or preprocessor
    if not isinstance(settings, dict) or "feature_size" not in settings:
        raise ModelConfigError(f"{directory}: no feature extractor settings ({PROCESSOR_CONFIG})")
    tokens = _media_tokens(directory, ("audio_token", "boa_token", "eoa_token"))
    length = processor.get("audio_seq_length") or preprocessor.get("audio_seq_length")
    soft_tokens = int(length or audio.soft_tokens)
    try:
        features = Gemma3nAudioFeatureConfig.from_hf(settings, tokens, soft_tokens)
    except AudioFeatureError as e:
        raise ModelConfigError(f"{directory}: {e}") from e
    if features.feature_size != audio.mel_bins:
        raise ModelConfigError(
            f"{directory}: the feature extractor makes {features.feature_size} mel bins, the "
            f"encoder takes {audio.mel_bins}"
        )
    longest = audio.num_rows(features.num_frames(features.max_samples))
    if soft_tokens != audio.soft_tokens or longest > soft_tokens:
        raise ModelConfigError(
            f"{directory}: the processor writes {soft_tokens} audio tokens a clip, the model "
            f"fills {audio.soft_tokens} and a {features.max_samples}-sample clip encodes to "
            f"{longest} rows"
        )
    return features


GEMMA4_VIDEO_TOKEN = "<|video|>"  # Gemma4Processor's, when the tokenizer's settings name none


def read_gemma4_video_config(directory: Path, cfg: ModelConfig) -> Gemma4VideoConfig | None:
    """How a Gemma 4 model's videos are sampled and their frames prepared (the processor's
    ``video_processor`` settings, else ``video_preprocessor_config.json``, else the video
    processor's defaults); None for a model without an image encoder."""
    vision = cfg.gemma4_vision
    if vision is None:
        return None
    settings = read_json(directory / PROCESSOR_CONFIG).get("video_processor") or read_json(
        directory / VIDEO_PREPROCESSOR_CONFIG
    )
    tokens = _media_tokens(directory, ("image_token", "boi_token", "eoi_token"))
    video_token = read_json(directory / TOKENIZER_CONFIG).get("video_token") or GEMMA4_VIDEO_TOKEN
    try:
        video = Gemma4VideoConfig.from_hf(settings or {}, tokens, str(video_token))
    except ValueError as e:  # ImageConfigError included
        raise ModelConfigError(f"{directory}: {e}") from e
    frames = video.frames
    if (frames.patch_size, frames.pooling) != (vision.patch_size, vision.pooling):
        raise ModelConfigError(
            f"{directory}: the video processor's {frames.patch_size} px patches pooled by "
            f"{frames.pooling} are not the encoder's ({vision.patch_size}, {vision.pooling})"
        )
    return video


@dataclass(frozen=True, slots=True)
class Gemma4Processing:
    """How a Gemma 4 model's media are prepared, for the encoders its checkpoint has."""

    image: Gemma4ImageConfig | None
    video: Gemma4VideoConfig | None
    audio: Gemma4AudioFeatureConfig | None


def read_gemma4_processing(directory: Path, cfg: ModelConfig) -> Gemma4Processing | None:
    """The Gemma 4 processor's settings; None for other models and text-only Gemma 4."""
    if cfg.gemma4_vision is None and cfg.gemma4_audio is None:
        return None
    return Gemma4Processing(
        read_gemma4_image_config(directory, cfg),
        read_gemma4_video_config(directory, cfg),
        read_gemma4_audio_config(directory, cfg),
    )
