"""Gemma 2 and Gemma 3 (text): the Llama decoder plus what Gemma changes.

- RMSNorm scales by ``1 + w`` (weights stored as offsets from one) and multiplies in float32;
- four norms per layer: around attention and around the MLP (sandwich), not just before each;
- embeddings are multiplied by ``sqrt(hidden_size)``;
- GeGLU (tanh-approximated GELU) MLP, attention scale ``query_pre_attn_scalar ** -0.5``;
- tanh soft-capping of attention scores and of the final logits;
- sliding-window attention on alternate layers (the window comes from ``ModelConfig``).

Gemma 3 keeps all that but drops both soft-caps, adds per-head q/k norms, interleaves five
sliding layers with one global one, and rotates its sliding layers with a smaller RoPE base.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from inferd.kernels.ops import Rotation, StackKernel
from inferd.layers.attention import AttentionMetadata, sliding_window_metadata
from inferd.layers.norm import RMSNorm
from inferd.layers.registered import Registered
from inferd.layers.rotary import RotaryEmbedding
from inferd.models.config import ModelConfig
from inferd.models.llama import (
    KVCache,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    SplitResidualLayer,
    stack_layer,
)


class GemmaRMSNorm(RMSNorm):
    """``(x / rms(x)) * (1 + w)``, computed in float32 and cast back once (as Gemma does)."""

    unit_offset = True


class Gemma2DecoderLayer(SplitResidualLayer):
    # Read straight from the registry on the hot path (layers/registered.py)
    input_norm = Registered[GemmaRMSNorm]()
    self_attn = Registered[LlamaAttention]()
    post_attention_norm = Registered[GemmaRMSNorm]()
    pre_feedforward_norm = Registered[GemmaRMSNorm]()
    mlp = Registered[LlamaMLP]()
    post_feedforward_norm = Registered[GemmaRMSNorm]()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_norm = GemmaRMSNorm(size, eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_norm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_norm = GemmaRMSNorm(size, eps)
        self.mlp = LlamaMLP(cfg)
        self.post_feedforward_norm = GemmaRMSNorm(size, eps)

    def forward_split(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        rotation: Rotation,
        meta: AttentionMetadata,
        cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaDecoderLayer.forward_split``: the layer on ``x + delta``, its output as
        (residual, delta). The sandwich's adds run inside the norms after them (``add_forward``)
        and submodules' ``forward`` is called directly (LlamaAttention.forward says why)."""
        x, h = self.input_norm.add_forward(x, delta)
        attn = self.post_attention_norm.forward(self.self_attn.forward(h, rotation, meta, cache))
        x, h = self.pre_feedforward_norm.add_forward(x, attn)
        return x, self.post_feedforward_norm.forward(self.mlp.forward(h))

    def stack_layer(self, kernel: StackKernel, dtype: torch.dtype) -> Any | None:
        norms = {
            "input_norm": self.input_norm,
            "attn_out_norm": self.post_attention_norm,
            "mlp_norm": self.pre_feedforward_norm,
            "mlp_out_norm": self.post_feedforward_norm,
        }
        return stack_layer(kernel, self.self_attn, self.mlp, norms, dtype)


class Gemma2ForCausalLM(LlamaForCausalLM):
    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return Gemma2DecoderLayer(cfg)

    def make_norm(self, cfg: ModelConfig) -> RMSNorm:
        return GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # The normalizer is rounded to the model dtype first, as the reference does.
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3Attention(LlamaAttention):
    """Gemma 2 attention without score soft-capping, plus per-head q/k norms in Gemma's
    ``1 + w`` form (Gemma 3)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.self_attn = Gemma3Attention(cfg)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): Gemma 2's layers with q/k norms, no soft-capping, and two rotations:
    sliding-window layers use ``rope_local_theta``, global layers ``rope_theta``.

    ``local_rotary`` is set by the loader (``loading/weights.build_empty``) beside ``rotary``.
    """

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, rotary)
        self.local_rotary = rotary

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return Gemma3DecoderLayer(cfg)

    def layer_rotaries(self) -> tuple[RotaryEmbedding, ...]:
        return tuple(self.local_rotary if s else self.rotary for s in self.sliding)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids) if embeds is None else embeds
        stacked = self.run_stack(x, positions, meta, kv_caches)
        if stacked is not None:
            return stacked
        global_rotation = self.rotary.at(positions, x.dtype)
        local_rotation = self.local_rotary.at(positions, x.dtype)
        window = self.config.sliding_window
        window_meta = sliding_window_metadata(meta, window) if window is not None else meta
        delta: torch.Tensor | None = None  # what a layer left to add (forward_split)
        layers: Any = zip(self.layers, kv_caches, self.sliding, strict=True)
        for layer, cache, sliding in layers:
            if sliding:
                x, delta = layer.forward_split(x, delta, local_rotation, window_meta, cache)
            else:
                x, delta = layer.forward_split(x, delta, global_rotation, meta, cache)
        return self.norm.add_forward(x, delta)[1]
