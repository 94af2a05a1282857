"""The shape of a decoder-only transformer, read from GGUF metadata (or, later, config.json)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inferd.layers.rotary import RopeScaling

# Architectures whose GGUF layout is the Llama one (same tensor names, same blocks).
LLAMA_FAMILY = frozenset({"llama", "mistral"})


class ModelConfigError(ValueError):
    """The model file describes something inferd cannot run; the message says what."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position: int
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"{self.num_heads} attention heads cannot be grouped over "
                f"{self.num_kv_heads} key/value heads"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, in float32 (halve for 16-bit)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


def config_from_gguf(meta: Mapping[str, Any], *, has_output_tensor: bool) -> ModelConfig:
    arch = str(meta.get("general.architecture", ""))
    if arch not in LLAMA_FAMILY:
        raise ModelConfigError(
            f"GGUF architecture {arch!r} is not supported yet (supported: "
            f"{', '.join(sorted(LLAMA_FAMILY))})"
        )

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelConfigError(f"GGUF metadata lacks {arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch),
        max_position=int(key("context_length", 2048)),
        tie_word_embeddings=not has_output_tensor,
    )


def _rope_scaling(meta: Mapping[str, Any], arch: str) -> RopeScaling:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return RopeScaling()
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    original = int(meta.get(f"{arch}.rope.scaling.original_context_length", 8192))
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor, original_max_position=original)
    if kind == "llama3":
        return RopeScaling(kind="llama3", factor=factor, original_max_position=original)
    raise ModelConfigError(f"rope scaling type {kind!r} is not supported")
