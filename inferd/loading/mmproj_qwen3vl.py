"""Qwen3-VL's image and video encoder from llama.cpp's projector file (``--mmproj``), as its
convert_hf_to_gguf.py (``Qwen3VLVisionModel``) writes it, beside a ``qwen3vl`` or
``qwen3vlmoe`` language model GGUF (loading/gguf_qwen3vl.py). Its ``clip.projector_type`` is
``qwen3vl_merger``.

The file records the encoder's width, depth, heads and MLP width, the patch size, the merge
(``spatial_merge_size``), which blocks feed the deep stack (``is_deepstack_layers``, one bool a
block), the mean and std; the tensors' shapes give the rest (the learned position grid, the
input channels, the output width). The language model records the M-RoPE sections and how many
layers the deep stack feeds, which must be as many as the projector's deep-stack blocks. What
neither records, transformers fixes and llama.cpp assumes: a temporal patch of 2 (the converter
writes nothing else), the encoder's LayerNorms' epsilon of 1e-6 (the file's is the text
model's, which the converter copies there), the 2-D rotary base of 10000, GELU (tanh).

Media are prepared as transformers' Qwen3-VL processor does with the published checkpoints'
settings (``preprocessor_config.json``: images of 256x256 to 4096x4096 pixels' worth;
``video_preprocessor_config.json``: videos of 4096 to 25165824 pixels over all their frames,
sampled at its video processor's defaults, 2 a second, 4 to 768 frames), at the file's patch
size, merge, mean and std; so a converted model reads media as its Hugging Face directory does.
The markers (``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``)
must be whole tokens of the language model's vocabulary.

Undone on reading: the patch embedding's Conv3d, which the converter split along time into two
Conv2d kernels (``v.patch_embd.weight`` and ``v.patch_embd.weight.1``), is stacked back. The
deep-stack mergers are named by the block that feeds them (``v.deepstack.{block}``), ours by
their order; the blocks' fused q/k/v is stored as transformers holds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from inferd.loading.gguf import GGUFFile
from inferd.loading.gguf_qwen3vl import QWEN3VL_ARCHITECTURES
from inferd.loading.hf_processor import QWEN_IMAGE_PIXELS, QWEN_VIDEO_PIXELS
from inferd.loading.mmproj import (
    ProjectorError,
    check_exact_tensors,
    required,
    required_shape,
    tensor_reader,
    whole_token_ids,
)
from inferd.loading.weights import WeightSource
from inferd.models.config import ModelConfig, ModelConfigError, QwenVisionConfig
from inferd.models.idefics3_image import ImageConfigError
from inferd.models.qwen2_vl_image import QwenVisualConfig
from inferd.models.qwen3_vl_video import VISION_END, VISION_START, Qwen3VideoConfig

QWEN3VL = "qwen3vl_merger"  # its clip.projector_type
# The markers Qwen3-VL's chat template and processor write: (image, video, start, end).
MARKERS = ("<|image_pad|>", "<|video_pad|>", VISION_START, VISION_END)
# The published checkpoints' pixel bounds (their processors' ``size``): an image's, a video's
# over all its frames.
IMAGE_SIZE = {"shortest_edge": 65_536, "longest_edge": 16_777_216}
VIDEO_SIZE = {"shortest_edge": 4_096, "longest_edge": 25_165_824}
TEMPORAL_PATCH = 2
DEFAULT_MERGE = 2  # llama.cpp's, for a file without spatial_merge_size
VISION_ROPE_BASE = 10000.0
PATCH_EMBED = "visual.patch_embed.proj.weight"
PATCH_KERNELS = ("v.patch_embd.weight", "v.patch_embd.weight.1")  # one a temporal step


@dataclass(frozen=True, slots=True)
class Qwen3VLProjector:
    """A checked Qwen3-VL projector: its file, the encoder, the language model's M-RoPE
    sections, and how images and videos are prepared."""

    gguf: GGUFFile
    vision: QwenVisionConfig
    mrope_section: tuple[int, int, int]
    visual: tuple[QwenVisualConfig, QwenVisualConfig]  # images, videos
    video: Qwen3VideoConfig

    @property
    def path(self) -> Path:
        return self.gguf.path

    def configure(self, cfg: ModelConfig) -> ModelConfig:
        """The language model's Qwen3 decoder made Qwen3-VL: this encoder feeding it, turned by
        interleaved M-RoPE."""
        return replace(
            cfg,
            architecture="qwen3_vl",
            qwen_vision=self.vision,
            mrope_section=self.mrope_section,
            mrope_interleaved=True,
        )

    def weight_sources(self) -> list[WeightSource]:
        plan = projector_plan(self.vision)
        return [WeightSource(PATCH_EMBED, self._patch_embedding)] + [
            WeightSource(ours, tensor_reader(self.gguf, theirs)) for ours, theirs in plan.items()
        ]

    def _patch_embedding(self) -> torch.Tensor:
        """[hidden, channels, time, p, p]: the converter's one kernel a temporal step, stacked."""
        return torch.stack([self.gguf.load_tensor(name) for name in PATCH_KERNELS], dim=2)


def qwen3vl_projector(gguf: GGUFFile, lm: Mapping[str, Any]) -> Qwen3VLProjector:
    """Check the Qwen3-VL projector ``gguf`` against the language model's GGUF metadata ``lm``;
    ProjectorError says what does not fit."""
    where, meta = str(gguf.path), gguf.metadata
    lm_arch = str(lm.get("general.architecture", ""))
    if lm_arch not in QWEN3VL_ARCHITECTURES:
        raise ProjectorError(
            f"{where}: a Qwen3-VL projector goes with a qwen3vl or qwen3vlmoe language model, "
            f"not {lm_arch!r}"
        )
    shapes = {i.name: i.shape for i in gguf.tensor_infos()}
    ids = whole_token_ids(where, lm, MARKERS, "Qwen3-VL")
    vision = _vision_config(where, meta, shapes, ids)
    _check_language_model(where, lm, vision)
    sections = _sections(where, lm)
    _check_tensors(where, shapes, vision)
    visual, video = _processing(where, meta, vision)
    return Qwen3VLProjector(gguf, vision, sections, visual, video)


def _vision_config(
    where: str, meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], ids: list[int]
) -> QwenVisionConfig:
    v = "clip.vision."
    depth = int(required(where, meta, v + "block_count"))
    flags = meta.get(v + "is_deepstack_layers") or []
    if len(flags) not in (0, depth):
        raise ProjectorError(
            f"{where}: {v}is_deepstack_layers has {len(flags)} entries for {depth} blocks"
        )
    for name in PATCH_KERNELS:  # the Conv3d's two temporal steps
        required_shape(where, shapes, name)
    try:
        return QwenVisionConfig(
            hidden_size=int(required(where, meta, v + "embedding_length")),
            intermediate_size=int(required(where, meta, v + "feed_forward_length")),
            num_layers=depth,
            num_heads=int(required(where, meta, v + "attention.head_count")),
            out_hidden_size=required_shape(where, shapes, "mm.2.weight")[0],
            patch_size=int(required(where, meta, v + "patch_size")),
            temporal_patch_size=TEMPORAL_PATCH,
            spatial_merge_size=int(meta.get(v + "spatial_merge_size") or DEFAULT_MERGE),
            window_size=0,  # as the directory's: every block attends over a whole frame
            fullatt_block_indexes=tuple(range(depth)),
            tokens_per_second=0.0,  # a video's frames are laid out one by one, not by time
            image_token_id=ids[0],
            video_token_id=ids[1],
            vision_start_token_id=ids[2],
            rope_theta=VISION_ROPE_BASE,
            in_channels=required_shape(where, shapes, PATCH_KERNELS[0])[1],
            deepstack_indexes=tuple(i for i, deep in enumerate(flags) if deep),
            num_position_embeddings=required_shape(where, shapes, "v.position_embd.weight")[0],
            hidden_act="gelu_tanh",
        )
    except ModelConfigError as exc:
        raise ProjectorError(f"{where}: {exc}") from None


def _sections(where: str, lm: Mapping[str, Any]) -> tuple[int, int, int]:
    """The language model's M-RoPE sections (temporal, height, width; the fourth, zero, is
    llama.cpp's padding), which must cover its heads' rotary pairs."""
    arch = str(lm["general.architecture"])
    sections = [int(s) for s in lm.get(f"{arch}.rope.dimension_sections") or []]
    head_dim = int(lm.get(f"{arch}.attention.key_length") or 0)
    if len(sections) < 3 or any(sections[3:]) or 2 * sum(sections) != head_dim:
        raise ProjectorError(
            f"{where}: the language model's M-RoPE sections {sections} "
            f"({arch}.rope.dimension_sections) do not cover its {head_dim}-wide heads"
        )
    return sections[0], sections[1], sections[2]


def _check_language_model(where: str, lm: Mapping[str, Any], vision: QwenVisionConfig) -> None:
    """The encoder's rows are the language model's width, and its deep stack feeds as many
    layers as the language model takes."""
    arch = str(lm["general.architecture"])
    width = int(lm.get(f"{arch}.embedding_length", 0))
    if vision.out_hidden_size != width:
        raise ProjectorError(
            f"{where}: the projector's encoder gives {vision.out_hidden_size}-wide embeddings; "
            f"the language model is {width} wide"
        )
    levels, taken = len(vision.deepstack_indexes), int(lm.get(f"{arch}.n_deepstack_layers", 0))
    if levels != taken or levels > int(lm.get(f"{arch}.block_count", 0)):
        raise ProjectorError(
            f"{where}: the projector's deep stack feeds {levels} layers; the language model "
            f"takes {taken} ({arch}.n_deepstack_layers)"
        )


def projector_plan(vision: QwenVisionConfig) -> dict[str, str]:
    """Our encoder's parameters (models/qwen3_vl.py) -> the projector's tensors, but for the
    patch embedding's weight (two tensors: ``PATCH_KERNELS``)."""
    plan = {
        "visual.patch_embed.proj.bias": "v.patch_embd.bias",
        "visual.pos_embed.weight": "v.position_embd.weight",
    }
    modules = {"merger.norm": "v.post_ln", "merger.linear_fc1": "mm.0", "merger.linear_fc2": "mm.2"}
    block = {
        "norm1": "ln1",
        "norm2": "ln2",
        "attn.qkv": "attn_qkv",
        "attn.proj": "attn_out",
        "mlp.linear_fc1": "ffn_up",
        "mlp.linear_fc2": "ffn_down",
    }
    for i in range(vision.num_layers):
        modules |= {f"blocks.{i}.{ours}": f"v.blk.{i}.{theirs}" for ours, theirs in block.items()}
    merger = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}
    for k, source in enumerate(vision.deepstack_indexes):
        modules |= {
            f"deepstack_merger_list.{k}.{ours}": f"v.deepstack.{source}.{theirs}"
            for ours, theirs in merger.items()
        }
    for ours, theirs in modules.items():
        for kind in ("weight", "bias"):
            plan[f"visual.{ours}.{kind}"] = f"{theirs}.{kind}"
    return plan


def _check_tensors(
    where: str, shapes: Mapping[str, tuple[int, ...]], vision: QwenVisionConfig
) -> None:
    """Exactly the tensors of a Qwen3-VL projector of this shape, each deep-stack merger giving
    the language model's width too (a tensor of another shape is refused as it is read)."""
    wanted = {*projector_plan(vision).values(), *PATCH_KERNELS}
    check_exact_tensors(where, shapes, wanted, "a Qwen3-VL projector of this shape")
    for source in vision.deepstack_indexes:
        out = shapes[f"v.deepstack.{source}.fc2.weight"][0]
        if out != vision.out_hidden_size:
            raise ProjectorError(
                f"{where}: the deep-stack merger of block {source} gives {out}-wide rows; the "
                f"language model is {vision.out_hidden_size} wide"
            )
    kernel = (vision.hidden_size, vision.in_channels, vision.patch_size, vision.patch_size)
    for name in PATCH_KERNELS:
        if shapes[name] != kernel:
            raise ProjectorError(
                f"{where}: {name} has shape {shapes[name]}, not {vision.patch_size} px patches "
                f"into {vision.hidden_size} channels"
            )


def _processing(
    where: str, meta: Mapping[str, Any], vision: QwenVisionConfig
) -> tuple[tuple[QwenVisualConfig, QwenVisualConfig], Qwen3VideoConfig]:
    """The published processors' settings at the encoder's patches and the file's mean and
    std (``visual``: images, videos; and how videos are sampled)."""
    settings = {
        "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": vision.spatial_merge_size,
        "image_mean": required(where, meta, "clip.vision.image_mean"),
        "image_std": required(where, meta, "clip.vision.image_std"),
    }
    video = {**settings, "size": VIDEO_SIZE}
    try:
        images = QwenVisualConfig.from_hf({**settings, "size": IMAGE_SIZE}, QWEN_IMAGE_PIXELS)
        videos = QwenVisualConfig.from_hf(video, QWEN_VIDEO_PIXELS)
        return (images, videos), Qwen3VideoConfig.from_hf(video)
    except ImageConfigError as exc:
        raise ProjectorError(f"{where}: {exc}") from None
