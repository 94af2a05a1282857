"""Build a Llama-family model from a GGUF file: config from metadata, weights dequantized."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from gguf import GGMLQuantizationType

from inferd.layers.linear import PackedKind
from inferd.layers.rotary import inverse_frequencies
from inferd.loaders.gguf import GGUFFile
from inferd.models.config import ModelConfig, config_from_gguf
from inferd.models.llama import LlamaForCausalLM
from inferd.models.weights import WeightSource, build_empty, fill
from inferd.quantize import Isq

log = logging.getLogger(__name__)

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    """``auto`` takes bf16 where the CPU computes it natively (AVX512-BF16/AMX), else f32."""
    if name == "auto":
        capability = torch.backends.cpu.get_cpu_capability()
        return torch.bfloat16 if capability in ("AVX512", "AVX512_BF16", "AMX") else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


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
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model; ``packed_kernels`` adds int4/int8 copies for small batches (bf16 only);
    ``isq`` quantizes every projection instead (see inferd/quantize.py)."""
    infos = {info.name: info for info in gguf.tensor_infos()}
    names = set(infos)
    cfg = config_from_gguf(gguf.metadata, has_output_tensor="output.weight" in names)
    freq_factors = gguf.load_tensor("rope_freqs.weight") if "rope_freqs.weight" in names else None
    inv_freq = inverse_frequencies(cfg.rotary_size, cfg.rope_theta, cfg.rope_scaling, freq_factors)
    model = build_empty(cfg, inv_freq, dtype)
    plan = _weight_plan(cfg)
    if cfg.tie_word_embeddings:
        plan["lm_head.weight"] = plan["embed_tokens.weight"]

    def read(sources: list[str], transform: Transform) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            parts = [transform(gguf.load_tensor(s), s) for s in sources]
            return torch.cat(parts) if len(parts) > 1 else parts[0]

        return load

    weights = (
        WeightSource(target, read(srcs, transform), _packed_kind(infos[s].qtype for s in srcs))
        for target, (srcs, transform) in plan.items()
    )
    fill(
        model,
        weights,
        dtype,
        total=len(plan),
        packed_kernels=packed_kernels,
        isq=isq,
        progress=progress,
    )
    return model, cfg


Transform = Callable[[torch.Tensor, str], torch.Tensor]

# Source blocks that are affine 4-bit groups of 32: int4 repacks them without further loss.
_INT4_EXACT = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1})


def _packed_kind(qtypes: Iterable[GGMLQuantizationType]) -> PackedKind:
    """int4 only where the file already held 4-bit groups; int8 never loses more than that."""
    return PackedKind.INT4 if set(qtypes) <= _INT4_EXACT else PackedKind.INT8


def _weight_plan(cfg: ModelConfig) -> dict[str, tuple[list[str], Transform]]:
    def keep(t: torch.Tensor, _: str) -> torch.Tensor:
        return t

    def rope_rows(t: torch.Tensor, name: str) -> torch.Tensor:
        heads = cfg.num_heads if name.endswith("attn_q.weight") else cfg.num_kv_heads
        return unpermute_rope(t, heads)

    plan: dict[str, tuple[list[str], Transform]] = {
        "embed_tokens.weight": (["token_embd.weight"], keep),
        "norm.weight": (["output_norm.weight"], keep),
    }
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = (["output.weight"], keep)
    for i in range(cfg.num_layers):
        b, m = f"blk.{i}.", f"layers.{i}."
        qkv = [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"]
        plan[m + "input_norm.weight"] = ([b + "attn_norm.weight"], keep)
        plan[m + "self_attn.qkv_proj.weight"] = (
            qkv,
            lambda t, n: rope_rows(t, n) if "attn_v" not in n else t,
        )
        plan[m + "self_attn.o_proj.weight"] = ([b + "attn_output.weight"], keep)
        plan[m + "post_attention_norm.weight"] = ([b + "ffn_norm.weight"], keep)
        plan[m + "mlp.gate_up_proj.weight"] = ([b + "ffn_gate.weight", b + "ffn_up.weight"], keep)
        plan[m + "mlp.down_proj.weight"] = ([b + "ffn_down.weight"], keep)
    return plan
