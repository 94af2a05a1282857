"""Build a model from a GGUF file: config from metadata, weights dequantized (the Llama family's
layouts here, Gemma 4's in loading/gguf_gemma4.py, Gemma 3n's in loading/gguf_gemma3n.py,
Qwen3-VL's text model's keys in loading/gguf_qwen3vl.py)."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable

import torch
from gguf import GGMLQuantizationType

from inferd.layers.linear import (
    INT4_GROUP,
    VNNI_TILE,
    PackedKind,
    PackedWeight,
    pack_int4_vnni_groups,
    pack_int8_vnni,
)
from inferd.layers.rotary import inverse_frequencies
from inferd.loading.dequant import FLOAT_TYPES, INT4_GROUP_TYPES
from inferd.loading.gguf import GGUFFile, GGUFTensorInfo, Transform
from inferd.loading.gguf_gemma3n import ARCH as GEMMA3N
from inferd.loading.gguf_gemma3n import gemma3n_config, gemma3n_weight_plan
from inferd.loading.gguf_gemma4 import ARCH as GEMMA4
from inferd.loading.gguf_gemma4 import gemma4_config, gemma4_weight_plan
from inferd.loading.gguf_qwen3vl import QWEN3VL_ARCHITECTURES, qwen3vl_config
from inferd.loading.projector import AnyProjector
from inferd.loading.quantize import Isq
from inferd.loading.weights import WeightSource, build_empty, fill
from inferd.models.config import LLAMA_FAMILY, ModelConfig, ModelConfigError, config_from_gguf
from inferd.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row interleave so rows follow the rotate-half rotary layout.

    The converter stored each head's rows as pairs (x0, x_half, x1, x_half+1, ...); rotate-half
    wants the two halves contiguous.
    """
    rows, cols = weight.shape
    head_dim = rows // num_heads
    w = weight.reshape(num_heads, head_dim // 2, 2, cols).transpose(1, 2)
    return w.reshape(rows, cols)


def load_gguf_model(
    gguf: GGUFFile,
    dtype: torch.dtype,
    *,
    progress: bool = True,
    packed_kernels: bool = True,
    isq: Isq | None = None,
    projector: AnyProjector | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model; ``packed_kernels`` adds int4/int8 copies for small batches (bf16; f32
    on AVX2);
    ``isq`` quantizes every projection instead (see loading/quantize.py); ``projector`` (a
    checked ``--mmproj`` file) adds its encoders and their projections to the decoder."""
    names = {info.name for info in gguf.tensor_infos()}
    cfg = gguf_config(gguf)
    if projector is not None:
        cfg = projector.configure(cfg)
    if any(n.startswith("rope_factors_") for n in names):
        raise ModelConfigError("LongRoPE scaling (rope_factors_* tensors) is not supported yet")
    freq_factors = None  # Gemma 4's rope_freqs mark its proportional RoPE: in its config
    if "rope_freqs.weight" in names and cfg.gemma4 is None:
        freq_factors = gguf.load_tensor("rope_freqs.weight")
    inv_freq = inverse_frequencies(cfg.rotary_size, cfg.rope_theta, cfg.rope_scaling, freq_factors)
    model = build_empty(cfg, inv_freq, dtype)
    weights = decoder_sources(gguf, cfg)
    if projector is not None:
        weights += projector.weight_sources()
    fill(
        model,
        weights,
        dtype,
        total=len(weights),
        packed_kernels=packed_kernels,
        isq=isq,
        progress=progress,
    )
    return model, cfg


def decoder_sources(gguf: GGUFFile, cfg: ModelConfig) -> list[WeightSource]:
    """Each parameter of the decoder ``cfg`` describes and how to read it from the file: the
    float32 weight (dequantized), the small-batch packing that keeps it exact, and the VNNI
    copy straight from the file's blocks where there is one."""
    infos = {info.name: info for info in gguf.tensor_infos()}
    plan = _plan(cfg)
    if cfg.tie_word_embeddings:
        plan["lm_head.weight"] = plan["embed_tokens.weight"]

    def read(sources: list[str], transform: Transform) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            parts = [transform(gguf.load_tensor(s), s) for s in sources]
            # fused along the rows: each expert's, in a stack of experts
            return torch.cat(parts, dim=max(0, parts[0].dim() - 2)) if len(parts) > 1 else parts[0]

        return load

    return [
        WeightSource(
            target,
            read(srcs, transform),
            _packed_kind(infos[s].qtype for s in srcs),
            _packed_reader(gguf, [infos[s] for s in srcs], transform, _pack_rows(cfg)),
        )
        for target, (srcs, transform) in plan.items()
    ]


def gguf_config(gguf: GGUFFile) -> ModelConfig:
    """The decoder's config from the file's metadata (and, for Gemma 4, Gemma 3n and
    Qwen3-VL-MoE, its tensors)."""
    arch = gguf.get("general.architecture")
    if arch == GEMMA4:
        return gemma4_config(gguf)
    if arch == GEMMA3N:
        return gemma3n_config(gguf)
    if arch in QWEN3VL_ARCHITECTURES:
        return qwen3vl_config(gguf)
    names = {info.name for info in gguf.tensor_infos()}
    return config_from_gguf(gguf.metadata, has_output_tensor="output.weight" in names)


def keep(t: torch.Tensor, _: str) -> torch.Tensor:
    """A tensor stored as we hold it."""
    return t


# Source blocks that are affine 4-bit groups of 32: int4 repacks them without further loss.
_INT4_EXACT = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1})


def _packed_kind(qtypes: Iterable[GGMLQuantizationType]) -> PackedKind:
    """int4 only where the file already held 4-bit groups; int8 never loses more than that."""
    return PackedKind.INT4 if set(qtypes) <= _INT4_EXACT else PackedKind.INT8


def _pack_rows(cfg: ModelConfig) -> int:
    """Rows read, transformed and packed at a time (~1024): whole tiles of 16 and whole heads (Q
    and K rows are un-permuted per head). A whole tensor's float32 copy (Llama 3 8B's vocabulary
    table: 2 GiB) would make loading need more RAM than serving."""
    unit = math.lcm(VNNI_TILE, cfg.head_dim)
    return unit * max(1, 1024 // unit)


def _packed_reader(
    gguf: GGUFFile, parts: list[GGUFTensorInfo], transform: Transform, chunk: int
) -> Callable[[], PackedWeight] | None:
    """How to build a projection's VNNI copy straight from the file's blocks, ``chunk`` rows at
    a time (``WeightSource.read_packed``): int4 where every part holds 4-bit groups (their
    codes, scales and mins kept, Q4_K's included), else int8 from each piece's float32 values
    (Q8_0's own codes). None where the weight stays dense: a float part (the file did not
    quantize it), or a shape the tiles do not fit."""
    widths = {p.shape[-1] for p in parts}
    if (
        any(p.qtype in FLOAT_TYPES or len(p.shape) != 2 for p in parts)
        or len(widths) != 1
        or any(p.shape[0] % VNNI_TILE for p in parts)
    ):
        return None
    groups, rem = divmod(widths.pop(), INT4_GROUP)
    if rem:
        return None
    int4 = all(p.qtype in INT4_GROUP_TYPES for p in parts)

    def read() -> PackedWeight:
        tiles = sum(p.shape[0] for p in parts) // VNNI_TILE
        vectors, sm = (4, 2) if int4 else (8, 1)
        packed = torch.empty((tiles, groups, vectors, 64), dtype=torch.uint8)
        scales = torch.empty((tiles, groups, sm, VNNI_TILE), dtype=torch.float16)
        tile = 0
        for part in parts:
            for start in range(0, part.shape[0], chunk):
                stop = min(start + chunk, part.shape[0])
                if int4:
                    found = gguf.load_int4_rows(part.name, start, stop)
                    codes, scale, lo = (transform(t, part.name) for t in found)
                    piece = pack_int4_vnni_groups(codes, scale, lo)
                else:
                    piece = pack_int8_vnni(
                        transform(gguf.load_rows(part.name, start, stop), part.name)
                    )
                n = len(piece[0])
                packed[tile : tile + n], scales[tile : tile + n] = piece
                tile += n
        return (PackedKind.INT4_VNNI if int4 else PackedKind.INT8_VNNI), packed, scales

    return read


def _plan(cfg: ModelConfig) -> dict[str, tuple[list[str], Transform]]:
    """Each of our parameters: llama.cpp's tensors it joins, and how to read each of them."""
    if cfg.gemma3n is not None:
        plan, transforms = gemma3n_weight_plan(cfg)
        return {ours: (theirs, transforms.get(ours, keep)) for ours, theirs in plan.items()}
    if cfg.gemma4 is not None:
        return {ours: (theirs, keep) for ours, theirs in gemma4_weight_plan(cfg).items()}
    return _weight_plan(cfg)


def _weight_plan(cfg: ModelConfig) -> dict[str, tuple[list[str], Transform]]:
    """Our parameters from llama.cpp's tensors. Q/K rows are un-permuted for the Llama family
    only (its converter alone permutes them); Gemma 2/3 norms (q/k norms too) are stored as
    ``1 + w``; the projections' tensors are ``llama_cpp_tensors``'; a mixture-of-experts
    layer's router and expert stacks are ``ffn_gate_inp`` and ``ffn_{gate,up,down}_exps``."""

    def rope_rows(t: torch.Tensor, name: str) -> torch.Tensor:
        if "attn_v" in name or cfg.architecture not in LLAMA_FAMILY:
            return t
        return unpermute_rope(t, t.shape[0] // cfg.head_dim)  # whole heads (a part of them too)

    gemma = cfg.architecture in ("gemma2", "gemma3")

    def norm(t: torch.Tensor, _: str) -> torch.Tensor:
        return t - 1 if gemma else t

    plan: dict[str, tuple[list[str], Transform]] = {
        "embed_tokens.weight": (["token_embd.weight"], keep),
        "norm.weight": (["output_norm.weight"], norm),
    }
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = (["output.weight"], keep)
    arch = cfg.architecture
    for i in range(cfg.num_layers):
        b, m = f"blk.{i}.", f"layers.{i}."
        plan[m + "input_norm.weight"] = ([b + "attn_norm.weight"], norm)
        qkv = _layer_tensors(i, "self_attn.qkv_proj", arch)
        plan[m + "self_attn.qkv_proj.weight"] = (qkv, rope_rows)
        if cfg.moe is not None and i in cfg.moe.layers:
            plan |= _experts_plan(b, m)
        else:
            for mlp in ("mlp.gate_up_proj", "mlp.down_proj"):
                plan[f"{m}{mlp}.weight"] = (_layer_tensors(i, mlp, arch), keep)
        if cfg.attention_bias:
            biases = [b + "attn_q.bias", b + "attn_k.bias", b + "attn_v.bias"]
            plan[m + "self_attn.qkv_proj.bias"] = (biases, keep)
        if cfg.qk_norm:
            plan[m + "self_attn.q_norm.weight"] = ([b + "attn_q_norm.weight"], norm)
            plan[m + "self_attn.k_norm.weight"] = ([b + "attn_k_norm.weight"], norm)
        plan[m + "self_attn.o_proj.weight"] = (_layer_tensors(i, "self_attn.o_proj", arch), keep)
        if gemma:
            plan[m + "post_attention_norm.weight"] = ([b + "post_attention_norm.weight"], norm)
            plan[m + "pre_feedforward_norm.weight"] = ([b + "ffn_norm.weight"], norm)
            plan[m + "post_feedforward_norm.weight"] = ([b + "post_ffw_norm.weight"], norm)
        else:
            plan[m + "post_attention_norm.weight"] = ([b + "ffn_norm.weight"], keep)
    return plan


def _experts_plan(b: str, m: str) -> dict[str, tuple[list[str], Transform]]:
    """A sparse layer's router and experts (layers/moe.py), ``b`` its tensors' prefix and ``m``
    its module's: each expert's gate and up rows fused as ``Experts.gate_up_proj`` holds them."""
    return {
        m + "mlp.gate.weight": ([b + "ffn_gate_inp.weight"], keep),
        m + "mlp.experts.gate_up_proj": (
            [b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"],
            keep,
        ),
        m + "mlp.experts.down_proj": ([b + "ffn_down_exps.weight"], keep),
    }


# llama.cpp's weight tensors (``blk.N.<name>.weight``) behind each of a layer's projections, in
# the order we fuse them; Phi-3 keeps q/k/v in one ``attn_qkv`` and gate/up in one ``ffn_up``.
_PROJECTION_TENSORS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}
_PHI3_PROJECTION_TENSORS = _PROJECTION_TENSORS | {
    "self_attn.qkv_proj": ("attn_qkv",),
    "mlp.gate_up_proj": ("ffn_up",),
}
_LAYER_MODULE = re.compile(r"layers\.(\d+)\.(.+)")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def llama_cpp_tensors(module: str, architecture: str) -> list[str] | None:
    """llama.cpp's names of the weight tensors that our projection ``module`` fuses
    (``layers.3.self_attn.qkv_proj`` -> ``blk.3.attn_q.weight``, ``blk.3.attn_k.weight``, ...;
    ``lm_head`` -> ``output.weight``); None for a module llama.cpp does not name."""
    if module == "lm_head":
        return ["output.weight"]
    found = _LAYER_MODULE.fullmatch(module)
    if found is None or found[2] not in _PROJECTION_TENSORS:
        return None
    return _layer_tensors(int(found[1]), found[2], architecture)


def _layer_tensors(layer: int, projection: str, architecture: str) -> list[str]:
    table = _PHI3_PROJECTION_TENSORS if architecture == "phi3" else _PROJECTION_TENSORS
    return [f"blk.{layer}.{name}.weight" for name in table[projection]]


def projection_of_tensor(name: str) -> str | None:
    """Our projection that llama.cpp's weight tensor ``name`` is (a part of), whatever the
    architecture (each llama.cpp name belongs to one projection in all of them); None for
    another tensor."""
    if name == "output.weight":
        return "lm_head"
    found = _LAYER_TENSOR.fullmatch(name)
    if found is None:
        return None
    for table in (_PROJECTION_TENSORS, _PHI3_PROJECTION_TENSORS):
        for projection, tensors in table.items():
            if found[2] in tensors:
                return f"layers.{found[1]}.{projection}"
    return None
