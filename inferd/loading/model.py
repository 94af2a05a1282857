"""One path from a model source to a loaded model, for a GGUF file and a Hugging Face
directory alike: the decoder with its weights, its config, tokenizer, chat template, extra stop
ids, the ISQ request it was loaded under, and the source with its digest."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inferd.kernels import kernel_isa
from inferd.loading.chat_template import CHATML_TEMPLATE, ChatTemplate
from inferd.loading.gguf import GGUFFile
from inferd.loading.gguf_model import load_gguf_model
from inferd.loading.hf_model import generation_stop_ids, load_safetensors_model, load_tokenizer
from inferd.loading.hf_processor import (
    Gemma4Processing,
    ImageConfig,
    read_audio_config,
    read_gemma3n_audio_config,
    read_gemma4_processing,
    read_image_config,
    read_qwen3_video_config,
    read_video_config,
    read_visual_configs,
)
from inferd.loading.hf_tokenizer import chat_template_source
from inferd.loading.imatrix import Imatrix
from inferd.loading.matformer import MatformerSlice, matformer_slice
from inferd.loading.mmproj import Projector, ProjectorError
from inferd.loading.mmproj_gemma4 import Gemma4Projector
from inferd.loading.mmproj_qwen3vl import Qwen3VLProjector
from inferd.loading.projector import open_projector
from inferd.loading.quantize import Isq, isq_for
from inferd.loading.tokenizer import TokenizerBundle, tokenizer_from_gguf
from inferd.models.config import ModelConfig, ModelConfigError
from inferd.models.gemma3n_audio_features import Gemma3nAudioFeatureConfig
from inferd.models.llama import LlamaForCausalLM
from inferd.models.qwen2_vl_image import QwenVisualConfig
from inferd.models.qwen3_vl_video import Qwen3VideoConfig
from inferd.models.smolvlm_video import SmolVLMVideoConfig
from inferd.models.whisper_features import WhisperFeatureConfig
from inferd.source import ModelSource, resolve_source

log = logging.getLogger(__name__)

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    """A decoder ready for an engine, and what is needed to talk to it."""

    source: ModelSource  # its digest keys the KV prefix cache and the stored ISQ weights
    model: LlamaForCausalLM
    config: ModelConfig
    dtype: torch.dtype
    tokenizer: TokenizerBundle
    chat_template: ChatTemplate
    stop_ids: tuple[int, ...] = ()  # EOS ids beyond the tokenizer's and the template's markers
    isq: Isq | None = None
    image_config: ImageConfig | None = None  # how to prepare images (vision models)
    audio_config: WhisperFeatureConfig | None = None  # how to featurize audio (audio models)
    projector: Path | None = None  # the --mmproj file the encoders came from
    # Qwen2.5-VL: how to prepare images and videos (its image and video processors' settings).
    visual_configs: tuple[QwenVisualConfig, QwenVisualConfig] | None = None
    video_config: SmolVLMVideoConfig | None = None  # SmolVLM2: how to sample and prepare videos
    qwen3_video: Qwen3VideoConfig | None = None  # Qwen3-VL: how to sample and prepare videos
    gemma4: Gemma4Processing | None = None  # Gemma 4: how to prepare images, videos, audio
    gemma3n_audio: Gemma3nAudioFeatureConfig | None = None  # Gemma 3n: how to featurize audio


def resolve_dtype(name: str) -> torch.dtype:
    """``auto`` takes bf16 where the CPU computes it natively (the kernels' ``avx512`` ISA:
    AVX512-BF16 and VNNI, AMX machines included), else f32, with int4/int8 weight copies where
    the kernels are the AVX2 build (``kernels.packs_weights``). Forcing the AVX2 kernels
    (``INFERD_KERNEL_ISA=avx2``) runs the machine as an AVX2 one: f32."""
    if name == "auto":
        try:
            isa = kernel_isa()
        except ValueError:  # a bad INFERD_KERNEL_ISA: the kernels' load says so
            isa = None
        return torch.bfloat16 if isa is not None and isa.name == "avx512" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def load(
    source: ModelSource | str | Path,
    *,
    dtype: str = "auto",
    isq: str | None = None,
    imatrix: Imatrix | None = None,
    packed_kernels: bool = True,
    progress: bool = True,
    chat_template: str | None = None,
    mmproj: str | Path | None = None,
    config_overrides: Mapping[str, Any] | None = None,
    matformer: tuple[str | Path, str] | None = None,
) -> LoadedModel:
    """Load a .gguf file or a Hugging Face directory (a ``str`` or ``Path`` is resolved first,
    as ``resolve_source`` does). ``isq``: q8 | q4, from the store when it holds the weights
    (quantized for ``imatrix``'s importance, if given: loading/imatrix.py);
    ``packed_kernels``: int4/int8 copies for small batches (bf16; f32 on AVX2); ``chat_template``:
    Jinja source that replaces the model's own template; ``mmproj``: a llama.cpp multimodal
    projector file for a GGUF language model (loading/projector.py); ``config_overrides``: merged
    into a Hugging Face directory's config.json (a GGUF file has none: refused);
    ``matformer``: (slice table, slice name), the MatFormer slice of a Gemma 3n directory to
    build (loading/matformer.py), read before any weight."""
    if not isinstance(source, ModelSource):
        source = resolve_source(str(source))
    torch_dtype = resolve_dtype(dtype)
    request = isq_for(isq, source.digest, imatrix=imatrix)
    if source.path.is_dir():
        if mmproj is not None:
            raise ProjectorError(
                f"{source.path}: --mmproj goes with a GGUF language model; a Hugging Face "
                "directory carries its own vision encoder"
            )
        cut = None
        if matformer is not None:
            if isq is not None:
                raise ModelConfigError(
                    "in-situ quantization of a MatFormer slice is not supported yet"
                )
            cut = matformer_slice(*matformer)
        return _load_hf(
            source,
            torch_dtype,
            request,
            packed_kernels,
            progress,
            chat_template,
            config_overrides,
            cut,
        )
    if matformer is not None:
        raise ModelConfigError(
            f"{source.path}: MatFormer slices (--matformer-slice) cut a Gemma 3n Hugging Face "
            "directory, not a GGUF file"
        )
    if config_overrides:
        raise ModelConfigError(
            f"{source.path}: config overrides (--hf-config-overrides) apply to a Hugging Face "
            "directory's config.json; a GGUF file carries its settings in its metadata"
        )
    return _load_gguf(source, torch_dtype, request, packed_kernels, progress, chat_template, mmproj)


def _load_gguf(
    source: ModelSource,
    dtype: torch.dtype,
    isq: Isq | None,
    packed_kernels: bool,
    progress: bool,
    chat_template: str | None,
    mmproj: str | Path | None = None,
) -> LoadedModel:
    gguf = GGUFFile(source.path)
    # The projector is checked against the language model before any weight is read.
    projector = open_projector(mmproj, gguf.metadata) if mmproj is not None else None
    model, cfg = load_gguf_model(
        gguf, dtype, progress=progress, packed_kernels=packed_kernels, isq=isq, projector=projector
    )
    tokenizer = tokenizer_from_gguf(gguf.metadata)
    template = ChatTemplate.from_metadata(
        gguf.metadata, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token
    )
    if chat_template is not None:
        template = ChatTemplate(chat_template, template.bos_token, template.eos_token)
    if projector is None:
        return LoadedModel(source, model, cfg, dtype, tokenizer, template, isq=isq)
    return LoadedModel(
        source,
        model,
        cfg,
        dtype,
        tokenizer,
        template,
        isq=isq,
        image_config=projector.image if isinstance(projector, Projector) else None,
        projector=projector.path,
        visual_configs=projector.visual if isinstance(projector, Qwen3VLProjector) else None,
        qwen3_video=projector.video if isinstance(projector, Qwen3VLProjector) else None,
        gemma4=projector.processing if isinstance(projector, Gemma4Projector) else None,
    )


def _load_hf(
    source: ModelSource,
    dtype: torch.dtype,
    isq: Isq | None,
    packed_kernels: bool,
    progress: bool,
    chat_template: str | None,
    config_overrides: Mapping[str, Any] | None = None,
    matformer: MatformerSlice | None = None,
) -> LoadedModel:
    directory = source.path
    model, cfg = load_safetensors_model(
        directory,
        dtype,
        progress=progress,
        packed_kernels=packed_kernels,
        isq=isq,
        config_overrides=config_overrides,
        matformer=matformer,
    )
    if cfg.gemma3n is not None and cfg.gemma3n.unserved_media:
        log.warning(
            "%s: gemma3n's %s encoder is not served (no MobileNet-v5 in the checkpoint); "
            "serving %s",
            directory,
            " and ".join(cfg.gemma3n.unserved_media),
            " and ".join(cfg.input_modalities),
        )
    tokenizer = load_tokenizer(directory, cfg)
    template_source = chat_template or chat_template_source(directory)
    if template_source is None:
        log.warning("%s has no chat template; using ChatML", directory)
        template_source = CHATML_TEMPLATE
    template = ChatTemplate(template_source, tokenizer.bos_token or "", tokenizer.eos_token or "")
    stop_ids = tuple(generation_stop_ids(directory))
    images = read_image_config(directory, cfg)
    audio = read_audio_config(directory, cfg)
    visual = read_visual_configs(directory, cfg)
    video = read_video_config(directory, cfg, images)
    return LoadedModel(
        *(source, model, cfg, dtype, tokenizer, template, stop_ids, isq),
        image_config=images,
        audio_config=audio,
        visual_configs=visual,
        video_config=video,
        qwen3_video=read_qwen3_video_config(directory, cfg),
        gemma4=read_gemma4_processing(directory, cfg),
        gemma3n_audio=read_gemma3n_audio_config(directory, cfg),
    )
