"""Gemma 4's image and audio encoders from llama.cpp's projector file (``--mmproj``), as its
convert_hf_to_gguf.py (``Gemma4VisionAudioModel``) writes them, beside a ``gemma4`` language
model GGUF (loading/gguf_gemma4.py).

The image encoder (``clip.vision.projector_type`` = ``gemma4v``) is under ``v.*`` with its
projection into the text model as ``mm.input_projection``; the audio encoder (``gemma4a``)
under ``a.*`` with ``mm.a.input_projection``. A file may hold either or both.

The file records each encoder's width, depth and heads, the image patch size and the audio's
mel bins; the tensors' shapes give the rest of the shapes (head size, key/value heads, the
position table, conv channels and kernel, output width), and the presence of their tensors
whether projections are clipped and the pooled features standardized. What neither records,
llama.cpp assumes (tools/mtmd) and so does inferd; these are transformers' defaults too:
images pooled 3x3 (``clip.vision.projector.scale_factor`` where a file has it), 2-D RoPE base
100; audio attention in chunks of 12 frames seeing 13 back and none ahead, logits capped at
50, half-weighted feed-forwards, norms' epsilon 1e-6 (the file's audio epsilon is known
wrong, and llama.cpp ignores it); an image's tokens see each other both ways except on the
E2B and E4B text widths (1536, 2560), as llama.cpp decides it.

Media are prepared as transformers' Gemma 4 processor does with its defaults, at the file's
patch size, pooling and mel bins: images of up to 280 soft tokens, videos as 32 frames of up to
70, 16 kHz log-mel audio; so a converted model reads media as its Hugging Face directory does
(llama.cpp's own image preprocessing differs: between 70 and 1120 soft tokens). The markers
are the processor's (``<|image|>`` ...), which must be whole tokens of the language model's
vocabulary.

Undone on reading: the patch embedding stored as a [hidden, 3, p, p] convolution (ours is
linear over (row, column, channel)), the depthwise conv's squeezed channel axis, the attention's
``per_dim_scale`` stored after its softplus, and clip bounds stored as one-element vectors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from inferd.loading.gguf import GGUFFile
from inferd.loading.hf_processor import GEMMA4_VIDEO_TOKEN, Gemma4Processing
from inferd.loading.mmproj import (
    ProjectorError,
    check_exact_tensors,
    required,
    required_shape,
    tensor_reader,
    whole_token_ids,
)
from inferd.loading.weights import WeightSource
from inferd.models.config import Gemma4AudioConfig, Gemma4VisionConfig, ModelConfig
from inferd.models.gemma4_audio_features import Gemma4AudioFeatureConfig
from inferd.models.gemma4_image import Gemma4ImageConfig
from inferd.models.gemma4_video import Gemma4VideoConfig
from inferd.models.idefics3_image import ImageConfigError

VISION_KIND, AUDIO_KIND = "gemma4v", "gemma4a"
GEMMA4_KINDS = (VISION_KIND, AUDIO_KIND)
LANGUAGE_MODEL = "gemma4"
# Gemma4Processor's markers: (placeholder, begin, end) of an image, of audio; a video's frames
# are written with the image's begin and end around the video placeholder.
IMAGE_TOKENS = ("<|image|>", "<|image>", "<image|>")
AUDIO_TOKENS = ("<|audio|>", "<|audio>", "<audio|>")
DEFAULT_POOLING = 3
VISION_ROPE_BASE = 100.0
NORM_EPS = 1e-6
CAUSAL_IMAGE_WIDTHS = (1536, 2560)  # E2B, E4B: llama.cpp keeps their image tokens causal
# The audio attention's shape and the conformer's settings llama.cpp hard-codes.
AUDIO_CHUNK, AUDIO_CONTEXT_LEFT, AUDIO_LOGIT_CAP, AUDIO_RESIDUAL = 12, 13, 50.0, 0.5
AUDIO_INVALID_LOGIT, AUDIO_GRADIENT_CLIPPING = -1.0e9, 1.0e10
_BOUNDS = ("input_min", "input_max", "output_min", "output_max")

Transform = Callable[[torch.Tensor], torch.Tensor]
Plan = dict[str, tuple[str, Transform | None]]  # ours -> (theirs, how to undo the converter)


@dataclass(frozen=True, slots=True)
class Gemma4Projector:
    """A checked Gemma 4 projector: its file, the encoders it holds, how media are prepared."""

    gguf: GGUFFile
    vision: Gemma4VisionConfig | None
    audio: Gemma4AudioConfig | None
    processing: Gemma4Processing

    @property
    def path(self) -> Path:
        return self.gguf.path

    def configure(self, cfg: ModelConfig) -> ModelConfig:
        """The language model's config with these encoders added."""
        return replace(cfg, gemma4_vision=self.vision, gemma4_audio=self.audio)

    def weight_sources(self) -> list[WeightSource]:
        return [
            WeightSource(ours, tensor_reader(self.gguf, theirs, transform))
            for ours, (theirs, transform) in projector_plan(self.vision, self.audio).items()
        ]


def gemma4_projector(gguf: GGUFFile, lm: Mapping[str, Any]) -> Gemma4Projector:
    """Check the Gemma 4 projector ``gguf`` against the language model's GGUF metadata ``lm``;
    ProjectorError says what does not fit."""
    where, meta = str(gguf.path), gguf.metadata
    lm_arch = str(lm.get("general.architecture", ""))
    if lm_arch != LANGUAGE_MODEL:
        raise ProjectorError(
            f"{where}: a Gemma 4 projector goes with a gemma4 language model, not {lm_arch!r}"
        )
    text_width = int(lm.get(f"{LANGUAGE_MODEL}.embedding_length", 0))
    shapes = {i.name: i.shape for i in gguf.tensor_infos()}
    vision = audio = None
    image = video = features = None
    if meta.get("clip.vision.projector_type") == VISION_KIND:
        ids = whole_token_ids(where, lm, (*IMAGE_TOKENS, GEMMA4_VIDEO_TOKEN), "Gemma 4")
        vision = _vision_config(where, meta, shapes, text_width, ids[0], ids[-1])
        image, video = _image_configs(where, meta, vision)
    if meta.get("clip.audio.projector_type") == AUDIO_KIND:
        audio_id = whole_token_ids(where, lm, AUDIO_TOKENS, "Gemma 4")[0]
        audio = _audio_config(where, meta, shapes, audio_id)
        features = Gemma4AudioFeatureConfig.from_hf(
            {"feature_size": audio.conv_channels[0]}, AUDIO_TOKENS
        )
    _check_tensors(gguf, shapes, vision, audio, text_width)
    return Gemma4Projector(gguf, vision, audio, Gemma4Processing(image, video, features))


def _vision_config(
    where: str,
    meta: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    text_width: int,
    image_token_id: int,
    video_token_id: int,
) -> Gemma4VisionConfig:
    v = "clip.vision."
    heads = int(required(where, meta, v + "attention.head_count"))
    head_dim = required_shape(where, shapes, "v.blk.0.attn_q_norm.weight")[0]
    return Gemma4VisionConfig(
        hidden_size=int(required(where, meta, v + "embedding_length")),
        intermediate_size=int(required(where, meta, v + "feed_forward_length")),
        num_layers=int(required(where, meta, v + "block_count")),
        num_heads=heads,
        num_kv_heads=required_shape(where, shapes, "v.blk.0.attn_k.weight")[0] // head_dim,
        head_dim=head_dim,
        patch_size=int(required(where, meta, v + "patch_size")),
        pooling=int(meta.get(v + "projector.scale_factor") or DEFAULT_POOLING),
        position_table_size=required_shape(where, shapes, "v.position_embd.weight")[1],
        rms_norm_eps=float(meta.get(v + "attention.layer_norm_epsilon") or NORM_EPS),
        rope_theta=VISION_ROPE_BASE,
        standardize="v.std_bias" in shapes,
        clipped_linears="v.blk.0.attn_q.input_max" in shapes,
        image_token_id=image_token_id,
        video_token_id=video_token_id,
        bidirectional=text_width not in CAUSAL_IMAGE_WIDTHS,
    )


def _image_configs(
    where: str, meta: Mapping[str, Any], vision: Gemma4VisionConfig
) -> tuple[Gemma4ImageConfig, Gemma4VideoConfig]:
    """The processor's defaults at the encoder's patches and pooling; the file's mean and std
    must leave pixels as they are (the encoder maps them to [-1, 1] itself)."""
    settings = {
        "patch_size": vision.patch_size,
        "pooling_kernel_size": vision.pooling,
        "do_normalize": True,
        "image_mean": meta.get("clip.vision.image_mean"),
        "image_std": meta.get("clip.vision.image_std"),
    }
    try:
        return (
            Gemma4ImageConfig.from_hf(settings, IMAGE_TOKENS),
            Gemma4VideoConfig.from_hf(settings, IMAGE_TOKENS, GEMMA4_VIDEO_TOKEN),
        )
    except ImageConfigError as exc:
        raise ProjectorError(f"{where}: {exc}") from None


def _audio_config(
    where: str, meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], token_id: int
) -> Gemma4AudioConfig:
    a = "clip.audio."
    mel_bins = int(required(where, meta, a + "num_mel_bins"))
    first = required_shape(where, shapes, "a.conv1d.0.weight")[0]
    second = required_shape(where, shapes, "a.conv1d.1.weight")[0]
    if mel_bins != first:
        raise ProjectorError(
            f"{where}: the projector says {mel_bins} mel bins, its first conv block has "
            f"{first} channels"
        )
    return Gemma4AudioConfig(
        hidden_size=int(required(where, meta, a + "embedding_length")),
        num_layers=int(required(where, meta, a + "block_count")),
        num_heads=int(required(where, meta, a + "attention.head_count")),
        conv_channels=(first, second),
        conv_kernel_size=required_shape(where, shapes, "a.blk.0.conv_dw.weight")[1],
        residual_weight=AUDIO_RESIDUAL,
        chunk_size=AUDIO_CHUNK,
        context_left=AUDIO_CONTEXT_LEFT,
        context_right=0,
        logit_cap=AUDIO_LOGIT_CAP,
        invalid_logit=AUDIO_INVALID_LOGIT,
        clipped_linears="a.blk.0.attn_q.input_max" in shapes,
        rms_norm_eps=NORM_EPS,
        gradient_clipping=AUDIO_GRADIENT_CLIPPING,
        output_dims=required_shape(where, shapes, "a.pre_encode.out.weight")[0],
        audio_token_id=token_id,
    )


def _patches_as_linear(t: torch.Tensor) -> torch.Tensor:
    """[hidden, 3, p, p] (the converter's convolution) -> [hidden, p * p * 3] over (row,
    column, channel), as our patch embedding and transformers' take a flattened patch."""
    return t.permute(0, 2, 3, 1).reshape(t.shape[0], -1).contiguous()


def _inverse_softplus(t: torch.Tensor) -> torch.Tensor:
    """The converter stores ``softplus(per_dim_scale)``; our attention applies the softplus."""
    return (t.double() + torch.log(-torch.expm1(-t.double()))).float()


def _scalar(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(())


def _unsqueeze_channel(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(1)


def _clippable(plan: Plan, ours: str, theirs: str, clipped: bool) -> None:
    """A ClippableLinear: its weight, and its four bounds where it clips."""
    plan[ours + ".linear.weight"] = (theirs + ".weight", None)
    if clipped:
        for bound in _BOUNDS:
            plan[f"{ours}.{bound}"] = (f"{theirs}.{bound}", _scalar)


def _layer_plan(
    plan: Plan,
    ours: str,
    theirs: str,
    norms: Mapping[str, str],
    linears: Mapping[str, str],
    clipped: bool,
) -> None:
    """One encoder layer's norms (stored as they are) and ClippableLinears, ``norms`` and
    ``linears`` naming each of ours (under ``ours``) by the projector's (under ``theirs``)."""
    for name, stored in norms.items():
        plan[f"{ours}{name}.weight"] = (f"{theirs}{stored}.weight", None)
    for name, stored in linears.items():
        _clippable(plan, ours + name, theirs + stored, clipped)


def projector_plan(vision: Gemma4VisionConfig | None, audio: Gemma4AudioConfig | None) -> Plan:
    """Our encoders' parameters (models/gemma4_vision.py, gemma4_audio.py) -> the projector's
    tensors, and how to undo what the converter did to each."""
    plan: Plan = {}
    if vision is not None:
        embed = "vision_tower.patch_embedder."
        plan[embed + "input_proj.weight"] = ("v.patch_embd.weight", _patches_as_linear)
        plan[embed + "position_embedding_table"] = ("v.position_embd.weight", None)
        plan["embed_vision.embedding_projection.weight"] = ("mm.input_projection.weight", None)
        if vision.standardize:
            plan["vision_tower.std_bias"] = ("v.std_bias", None)
            plan["vision_tower.std_scale"] = ("v.std_scale", None)
        norms = {
            "input_layernorm": "ln1",
            "post_attention_layernorm": "attn_post_norm",
            "pre_feedforward_layernorm": "ln2",
            "post_feedforward_layernorm": "ffn_post_norm",
            "self_attn.q_norm": "attn_q_norm",
            "self_attn.k_norm": "attn_k_norm",
        }
        linears = {
            "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_out",
            "mlp.gate_proj": "ffn_gate",
            "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down",
        }
        for i in range(vision.num_layers):
            ours, theirs = f"vision_tower.encoder.layers.{i}.", f"v.blk.{i}."
            _layer_plan(plan, ours, theirs, norms, linears, vision.clipped_linears)
    if audio is not None:
        _audio_plan(plan, audio)
    return plan


def _audio_plan(plan: Plan, audio: Gemma4AudioConfig) -> None:
    sub = "audio_tower.subsample_conv_projection."
    for i in range(2):
        plan[f"{sub}layer{i}.conv.weight"] = (f"a.conv1d.{i}.weight", None)
        plan[f"{sub}layer{i}.norm.weight"] = (f"a.conv1d.{i}.norm.weight", None)
    plan[sub + "input_proj_linear.weight"] = ("a.input_projection.weight", None)
    plan["audio_tower.output_proj.weight"] = ("a.pre_encode.out.weight", None)
    plan["audio_tower.output_proj.bias"] = ("a.pre_encode.out.bias", None)
    plan["embed_audio.embedding_projection.weight"] = ("mm.a.input_projection.weight", None)
    norms = {
        "feed_forward1.pre_layer_norm": "ffn_norm",
        "feed_forward1.post_layer_norm": "ffn_post_norm",
        "feed_forward2.pre_layer_norm": "ffn_norm_1",
        "feed_forward2.post_layer_norm": "ffn_post_norm_1",
        # llama.cpp's tensor map swaps the light conv's two norms' names (clip.cpp reads
        # them back swapped): its conv_norm is the pre-norm, its norm_conv the inner one.
        "lconv1d.pre_layer_norm": "conv_norm",
        "lconv1d.conv_norm": "norm_conv",
        "norm_pre_attn": "attn_pre_norm",
        "norm_post_attn": "attn_post_norm",
        "norm_out": "ln2",
        "self_attn.relative_k_proj": "attn_k_rel",
    }
    linears = {
        "feed_forward1.ffw_layer_1": "ffn_up",
        "feed_forward1.ffw_layer_2": "ffn_down",
        "feed_forward2.ffw_layer_1": "ffn_up_1",
        "feed_forward2.ffw_layer_2": "ffn_down_1",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.post": "attn_out",
        "lconv1d.linear_start": "conv_pw1",
        "lconv1d.linear_end": "conv_pw2",
    }
    for i in range(audio.num_layers):
        ours, theirs = f"audio_tower.layers.{i}.", f"a.blk.{i}."
        _layer_plan(plan, ours, theirs, norms, linears, audio.clipped_linears)
        plan[ours + "self_attn.per_dim_scale"] = (
            theirs + "per_dim_scale.weight",
            _inverse_softplus,
        )
        plan[ours + "lconv1d.depthwise_conv1d.weight"] = (
            theirs + "conv_dw.weight",
            _unsqueeze_channel,
        )


def _check_tensors(
    gguf: GGUFFile,
    shapes: Mapping[str, tuple[int, ...]],
    vision: Gemma4VisionConfig | None,
    audio: Gemma4AudioConfig | None,
    text_width: int,
) -> None:
    """Every tensor the encoders read is there and nothing else is, and each projection into
    the text model gives the language model's width (a tensor of another shape is refused
    as it is read)."""
    where = str(gguf.path)
    if vision is None and audio is None:
        raise ProjectorError(
            f"{where}: the projector holds neither a gemma4v nor a gemma4a encoder"
        )
    for kind, encoder, projection in (
        ("image", vision, "mm.input_projection.weight"),
        ("audio", audio, "mm.a.input_projection.weight"),
    ):
        if encoder is None:
            continue
        out = required_shape(where, shapes, projection)[0]
        declared = gguf.get(f"clip.{'vision' if kind == 'image' else 'audio'}.projection_dim")
        if declared not in (None, text_width):
            out = int(declared)
        if out != text_width:
            raise ProjectorError(
                f"{where}: the projector's {kind} encoder gives {out}-wide embeddings; the "
                f"language model is {text_width} wide"
            )
    wanted = {theirs for theirs, _ in projector_plan(vision, audio).values()}
    check_exact_tensors(where, shapes, wanted, "a Gemma 4 projector of this shape")
    if vision is not None and math.prod(shapes["v.patch_embd.weight"][1:]) != vision.patch_dim:
        raise ProjectorError(
            f"{where}: v.patch_embd.weight has shape {shapes['v.patch_embd.weight']}, not "
            f"patches of {vision.patch_size} px"
        )
