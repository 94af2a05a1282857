"""Llama-family decoder (Llama, Mistral, SmolLM): RMSNorm, RoPE, grouped-query attention, SwiGLU.

Projections are fused (one QKV matmul, one gate+up matmul) to cut per-layer kernel launches.
``forward`` takes a flat batch of tokens from many requests; attention metadata says which
rows belong to whom and where their KV lives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inferd.layers.attention import AttentionMetadata, paged_attention
from inferd.layers.linear import Linear
from inferd.layers.norm import RMSNorm
from inferd.layers.rotary import RotaryEmbedding, Rotation
from inferd.models.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, rotation: Rotation, meta: AttentionMetadata, cache: KVCache
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotation.apply(q), rotation.apply(k)
        out = paged_attention(q, k, v, cache[0], cache[1], meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self, x: torch.Tensor, rotation: Rotation, meta: AttentionMetadata, cache: KVCache
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_norm(x), rotation, meta, cache)
        return x + self.mlp(self.post_attention_norm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        x = self.embed_tokens(input_ids)
        rotation = self.rotary.at(positions, x.dtype)  # shared by every layer
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rotation, meta, cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
