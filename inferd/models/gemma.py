"""Gemma 2: the Llama decoder plus what Gemma changes.

- RMSNorm scales by ``1 + w`` (weights stored as offsets from one) and multiplies in float32;
- four norms per layer: around attention and around the MLP (sandwich), not just before each;
- embeddings are multiplied by ``sqrt(hidden_size)``;
- GeGLU (tanh-approximated GELU) MLP, attention scale ``query_pre_attn_scalar ** -0.5``;
- tanh soft-capping of attention scores and of the final logits;
- sliding-window attention on alternate layers (the window comes from ``ModelConfig``).
"""

from __future__ import annotations

import torch
from torch import nn

from inferd.kernels.ops import Rotation
from inferd.layers.attention import AttentionMetadata
from inferd.layers.norm import RMSNorm
from inferd.models.config import ModelConfig
from inferd.models.llama import KVCache, LlamaAttention, LlamaForCausalLM, LlamaMLP


class GemmaRMSNorm(RMSNorm):
    """``(x / rms(x)) * (1 + w)``, computed in float32 and cast back once (as Gemma does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_norm = GemmaRMSNorm(size, eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_norm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_norm = GemmaRMSNorm(size, eps)
        self.mlp = LlamaMLP(cfg)
        self.post_feedforward_norm = GemmaRMSNorm(size, eps)

    def forward(
        self, x: torch.Tensor, rotation: Rotation, meta: AttentionMetadata, cache: KVCache
    ) -> torch.Tensor:
        x = x + self.post_attention_norm(self.self_attn(self.input_norm(x), rotation, meta, cache))
        return x + self.post_feedforward_norm(self.mlp(self.pre_feedforward_norm(x)))


class Gemma2ForCausalLM(LlamaForCausalLM):
    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return Gemma2DecoderLayer(cfg)

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # The normalizer is rounded to the model dtype first, as the reference does.
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
