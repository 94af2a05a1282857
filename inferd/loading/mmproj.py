"""The Idefics3 / SmolVLM kind of llama.cpp multimodal projector (``--mmproj FILE``), and
what every kind shares (loading/projector.py opens a file and picks its kind).

llama.cpp keeps a vision-language model's image encoder apart from its language model: an
``mmproj`` GGUF whose ``general.architecture`` is ``clip``, its settings under ``clip.*`` keys
and its tensors under ``v.*`` (the vision transformer) and ``mm.*`` (the connector). This kind
(``clip.projector_type`` = ``idefics3``) is a SigLIP encoder (models/vision.py) and a
pixel-shuffle connector (models/idefics3.py) on a Llama decoder.

Everything is checked before any weight is read, so a projector that does not fit the language
model (another projector type, another width, a tokenizer without the image tokens) fails at
startup with nothing half-loaded.

Image preprocessing comes from the projector's metadata: the tile size (``image_size``), the
first resize's long side (``preproc_image_size``, the processor's ``size.longest_edge``), the
mean and std, and the pixel shuffle's factor (with the patch size, the ``<image>`` tokens per
tile). What the GGUF files do not record, inferd takes from llama.cpp's behaviour for this
projector, which is also transformers' default: images are always split into tiles (plus the
global view) when ``preproc_image_size`` is present; Lanczos resampling; bytes rescaled by 1/255
before normalizing. A projector written without ``preproc_image_size`` (older converters) gets
no split: each image is resized to one tile, as llama.cpp did before the key existed. The
tokenizer, chat template and the image marker tokens come from the language model's GGUF.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from inferd.loading.gguf import GGUFFile
from inferd.loading.weights import WeightSource
from inferd.models.config import LLAMA_FAMILY, ModelConfig, ModelConfigError, VisionConfig
from inferd.models.idefics3_image import (
    FAKE_TOKEN,
    GLOBAL_TOKEN,
    IMAGE_TOKEN,
    MAX_GRID,
    Idefics3ImageConfig,
)

IDEFICS3 = "idefics3"  # its clip.projector_type
_WHOLE_TOKEN_TYPES = (3, 4)  # llama.cpp's CONTROL and USER_DEFINED: matched whole in text


class ProjectorError(ModelConfigError):
    """A projector file inferd cannot use with this language model; the message says why."""


@dataclass(frozen=True, slots=True)
class Projector:
    """A checked projector: its file, the encoder it describes, and how to prepare images."""

    gguf: GGUFFile
    projector_type: str
    vision: VisionConfig
    image: Idefics3ImageConfig

    @property
    def path(self) -> Path:
        return self.gguf.path

    def configure(self, cfg: ModelConfig) -> ModelConfig:
        """The language model's config with this encoder added."""
        return replace(cfg, vision=self.vision)

    def weight_sources(self) -> list[WeightSource]:
        """Our encoder and connector parameters, read from the projector as stored."""
        return [
            WeightSource(ours, tensor_reader(self.gguf, theirs))
            for ours, theirs in projector_plan(self.vision.num_layers).items()
        ]


def tensor_reader(
    gguf: GGUFFile, name: str, transform: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> Callable[[], torch.Tensor]:
    """Reads tensor ``name`` of ``gguf`` (float32), through ``transform`` where given."""
    if transform is None:
        return lambda: gguf.load_tensor(name)
    return lambda: transform(gguf.load_tensor(name))


def projector_plan(num_layers: int) -> dict[str, str]:
    """llama.cpp's names for the Idefics3 encoder (``v.``) and connector (``mm.model.fc``);
    the encoder's fc1/fc2 are its ffn_up/ffn_down, and no Q/K rows are permuted."""
    embed = "vision_model.embeddings."
    plan = {
        embed + "patch_embedding.weight": "v.patch_embd.weight",
        embed + "patch_embedding.bias": "v.patch_embd.bias",
        embed + "position_embedding.weight": "v.position_embd.weight",
        "vision_model.post_layernorm.weight": "v.post_ln.weight",
        "vision_model.post_layernorm.bias": "v.post_ln.bias",
        "connector.modality_projection.proj.weight": "mm.model.fc.weight",
    }
    per_layer = {
        "layer_norm1": "ln1",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.out_proj": "attn_out",
        "layer_norm2": "ln2",
        "mlp.fc1": "ffn_up",
        "mlp.fc2": "ffn_down",
    }
    for i in range(num_layers):
        for ours, theirs in per_layer.items():
            for kind in ("weight", "bias"):
                plan[f"vision_model.encoder.layers.{i}.{ours}.{kind}"] = (
                    f"v.blk.{i}.{theirs}.{kind}"
                )
    return plan


def idefics3_projector(gguf: GGUFFile, lm: Mapping[str, Any]) -> Projector:
    """Check the idefics3 projector ``gguf`` against the language model's GGUF metadata ``lm``;
    ProjectorError says what does not fit."""
    meta = gguf.metadata
    where = str(gguf.path)
    if not meta.get("clip.has_vision_encoder", False):
        raise ProjectorError(f"{where} has no vision encoder (clip.has_vision_encoder)")
    lm_arch = str(lm.get("general.architecture", ""))
    if lm_arch not in LLAMA_FAMILY:
        raise ProjectorError(
            f"{where}: an {IDEFICS3} projector goes with a Llama-architecture language model "
            f"(SmolVLM's), not {lm_arch!r}"
        )
    vision = _vision_config(where, meta, _image_token_id(where, lm))
    _check_width(gguf, vision, int(lm.get(f"{lm_arch}.embedding_length", 0)))
    _check_tensors(gguf, vision)
    image = _image_config(where, meta, vision)
    _check_grid_tokens(where, lm, image)
    return Projector(gguf, IDEFICS3, vision, image)


def whole_token_ids(
    where: str, lm: Mapping[str, Any], names: Sequence[str], kind: str
) -> list[int]:
    """The ids of marker tokens ``names`` in the language model's vocabulary, each of which
    must be a control or user-defined token (matched whole in text: a normal token's text is
    split by the BPE, and the encoder's rows would miss it); ``kind`` names the model family
    the projector goes with, for the message."""
    tokens = list(lm.get("tokenizer.ggml.tokens") or [])
    missing = [t for t in names if t not in tokens]
    if missing:
        raise ProjectorError(
            f"{where}: the language model's tokenizer has no {', '.join(missing)} token; this "
            f"projector goes with a {kind} language model"
        )
    types = list(lm.get("tokenizer.ggml.token_type") or [])
    plain = [t for t in names if types and types[tokens.index(t)] not in _WHOLE_TOKEN_TYPES]
    if plain:
        raise ProjectorError(
            f"{where}: the language model's tokenizer has {', '.join(plain)} as a normal token, "
            "not a control or user-defined one it keeps whole"
        )
    return [tokens.index(t) for t in names]


def required(where: str, meta: Mapping[str, Any], key: str) -> Any:
    """Metadata key ``key`` of the projector at ``where``; ProjectorError when absent."""
    value = meta.get(key)
    if value is None:
        raise ProjectorError(f"{where}: the projector's metadata lacks {key}")
    return value


def required_shape(where: str, shapes: Mapping[str, tuple[int, ...]], name: str) -> tuple[int, ...]:
    """The shape of tensor ``name`` of the projector at ``where``; ProjectorError when absent."""
    shape = shapes.get(name)
    if shape is None:
        raise ProjectorError(f"{where}: the projector lacks tensor {name}")
    return shape


def check_exact_tensors(
    where: str, names: Iterable[str], wanted: set[str], what: str, hint: str = ""
) -> None:
    """ProjectorError unless the projector at ``where`` holds exactly the tensors ``wanted``
    (``what``: the kind of projector they make, named in the message)."""
    held = set(names)
    missing, extra = sorted(wanted - held), sorted(held - wanted)
    if missing:
        raise ProjectorError(
            f"{where}: the projector lacks {len(missing)} tensors, e.g. {missing[0]}"
        )
    if extra:
        raise ProjectorError(
            f"{where}: the projector holds {len(extra)} tensors {what} has not, "
            f"e.g. {extra[0]}{hint}"
        )


def _vision_config(where: str, meta: Mapping[str, Any], image_token_id: int) -> VisionConfig:
    if meta.get("clip.use_silu", False):
        raise ProjectorError(f"{where}: a SiLU vision MLP (clip.use_silu) is not supported")
    v = "clip.vision."
    try:
        return VisionConfig(
            hidden_size=int(required(where, meta, v + "embedding_length")),
            intermediate_size=int(required(where, meta, v + "feed_forward_length")),
            num_layers=int(required(where, meta, v + "block_count")),
            num_heads=int(required(where, meta, v + "attention.head_count")),
            image_size=int(required(where, meta, v + "image_size")),
            patch_size=int(required(where, meta, v + "patch_size")),
            layer_norm_eps=float(required(where, meta, v + "attention.layer_norm_epsilon")),
            scale_factor=int(required(where, meta, v + "projector.scale_factor")),
            image_token_id=image_token_id,
            hidden_act="gelu_tanh",  # llama.cpp's GELU is the tanh form, as SigLIP's
        )
    except ModelConfigError as exc:
        raise ProjectorError(f"{where}: {exc}") from None


def _image_token_id(where: str, lm: Mapping[str, Any]) -> int:
    """The ``<image>`` placeholder's id; the language model must know the image markers."""
    markers = (IMAGE_TOKEN, FAKE_TOKEN, GLOBAL_TOKEN)
    return whole_token_ids(where, lm, markers, "SmolVLM / Idefics3")[0]


def _check_grid_tokens(where: str, lm: Mapping[str, Any], image: Idefics3ImageConfig) -> None:
    """A split image marks each tile ``<row_r_col_c>``: every mark its largest grid needs
    must be one token of the language model's."""
    if not image.splitting:
        return
    side = min(-(-image.longest_edge // image.tile), MAX_GRID)
    tokens = set(lm.get("tokenizer.ggml.tokens") or [])
    marks = [f"<row_{r}_col_{c}>" for r in range(1, side + 1) for c in range(1, side + 1)]
    missing = [m for m in marks if m not in tokens]
    if missing:
        raise ProjectorError(
            f"{where}: images split into up to {side}x{side} tiles, but the language model's "
            f"tokenizer has no {missing[0]} token"
        )


def _check_width(gguf: GGUFFile, vision: VisionConfig, text_hidden: int) -> None:
    """The connector must map the shuffled encoder width onto the language model's width."""
    infos = {i.name: i for i in gguf.tensor_infos()}
    fc = infos.get("mm.model.fc.weight")
    if fc is None:
        raise ProjectorError(f"{gguf.path}: the projector has no connector (mm.model.fc.weight)")
    shuffled = vision.hidden_size * vision.scale_factor**2
    declared = gguf.get("clip.vision.projection_dim")
    if fc.shape != (text_hidden, shuffled) or declared not in (None, text_hidden):
        out = declared if declared not in (None, text_hidden) else fc.shape[0]
        raise ProjectorError(
            f"{gguf.path}: the projector's connector gives {out}-wide embeddings from "
            f"{fc.shape[-1]} inputs; the language model is {text_hidden} wide (and the encoder "
            f"gives {shuffled} after the pixel shuffle)"
        )


def _check_tensors(gguf: GGUFFile, vision: VisionConfig) -> None:
    """Exactly the tensors of an idefics3 projector of this shape (the connector's is checked
    by ``_check_width``), so that no weight read later can fail."""
    shapes = {i.name: i.shape for i in gguf.tensor_infos()}
    wanted = set(projector_plan(vision.num_layers).values())
    what = "an idefics3 projector"
    check_exact_tensors(str(gguf.path), shapes, wanted, what, " (another kind of projector?)")
    for name, shape in _expected_shapes(vision).items():
        if shapes[name] != shape:
            raise ProjectorError(
                f"{gguf.path}: tensor {name} has shape {shapes[name]}, the projector's metadata "
                f"says {shape}"
            )


def _expected_shapes(vision: VisionConfig) -> dict[str, tuple[int, ...]]:
    h, ff, p = vision.hidden_size, vision.intermediate_size, vision.patch_size
    shapes: dict[str, tuple[int, ...]] = {
        "v.patch_embd.weight": (h, vision.num_channels, p, p),
        "v.patch_embd.bias": (h,),
        "v.position_embd.weight": ((vision.image_size // p) ** 2, h),
        "v.post_ln.weight": (h,),
        "v.post_ln.bias": (h,),
    }
    for i in range(vision.num_layers):
        b = f"v.blk.{i}."
        for name in ("ln1", "ln2", "attn_q", "attn_k", "attn_v", "attn_out", "ffn_down"):
            shapes[b + name + ".bias"] = (h,)
        for name in ("ln1", "ln2"):
            shapes[b + name + ".weight"] = (h,)
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            shapes[b + name + ".weight"] = (h, h)
        shapes[b + "ffn_up.weight"], shapes[b + "ffn_up.bias"] = (ff, h), (ff,)
        shapes[b + "ffn_down.weight"] = (h, ff)
    return shapes


def _image_config(where: str, meta: Mapping[str, Any], vision: VisionConfig) -> Idefics3ImageConfig:
    mean = [float(x) for x in required(where, meta, "clip.vision.image_mean")]
    std = [float(x) for x in required(where, meta, "clip.vision.image_std")]
    if len(mean) != 3 or len(std) != 3:
        raise ProjectorError(f"{where}: image_mean and image_std need three values (RGB)")
    longest = meta.get("clip.vision.preproc_image_size")
    return Idefics3ImageConfig(
        longest_edge=int(longest) if longest else vision.image_size,
        tile=vision.image_size,
        image_seq_len=vision.tokens_per_tile,
        splitting=bool(longest),
        do_resize=bool(longest),
        mean=(mean[0], mean[1], mean[2]),
        std=(std[0], std[1], std[2]),
        resample=Image.Resampling.LANCZOS,
    )
