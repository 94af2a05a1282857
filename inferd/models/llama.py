"""Llama-family decoder (Llama, Mistral, SmolLM): RMSNorm, RoPE, grouped-query attention, SwiGLU.

Projections are fused (one QKV matmul, one gate+up matmul) to cut per-layer kernel launches.
``forward`` takes a flat batch of tokens from many requests; attention metadata says which
rows belong to whom and where their KV lives.

The same decoder runs the close relatives, switched by ``ModelConfig`` fields: Qwen2 (q/k/v
biases), Qwen3 (per-head q/k RMSNorm), Mistral (sliding window), Phi-3 (partial rotary; its fused
checkpoint tensors are a loader matter). Gemma 2 subclasses it (models/gemma.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inferd.kernels import fused
from inferd.layers.attention import (
    AttentionMetadata,
    attend_paged,
    paged_attention,
    sliding_window_metadata,
)
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
        self.rotary_dim = cfg.rotary_size
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # Int8 rows here cost most of their error (KL 0.011 of 0.017 on SmolLM2): bf16 here.
        self.qkv_proj = Linear(
            cfg.hidden_size,
            self.q_size + 2 * self.kv_size,
            bias=cfg.attention_bias,
            int8_activations=False,
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.attention_scale or cfg.head_dim**-0.5
        self.softcap = cfg.attn_softcap

    def forward(
        self, x: torch.Tensor, rotation: Rotation, meta: AttentionMetadata, cache: KVCache
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        kernels = fused()
        if kernels is not None and self.q_norm is None and self.rotary_dim == self.head_dim:
            # One kernel rotates q and k and writes k, v at their slots.
            q = kernels.rope_write_kv(
                qkv,
                rotation.positions,
                meta.slot_mapping,
                rotation.cos_table,
                rotation.signed_sin_table,
                cache[0],
                cache[1],
                self.num_heads,
            )
            out = attend_paged(q, cache[0], cache[1], meta, self.scale, softcap=self.softcap)
            return self.o_proj(out.reshape(-1, self.q_size))
        n, qk_size = qkv.shape[0], self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(n, self.num_kv_heads, self.head_dim)
        qk = qkv[:, :qk_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # Queries and keys are rotated together: one set of kernels instead of two.
        q, k = self._rotate(qk, rotation).split([self.num_heads, self.num_kv_heads], dim=1)
        out = paged_attention(q, k, v, cache[0], cache[1], meta, self.scale, softcap=self.softcap)
        return self.o_proj(out.reshape(-1, self.q_size))

    def _rotate(self, x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return rotation.apply(x)
        d = self.rotary_dim  # partial rotary: the rest of each head passes through
        return torch.cat((rotation.apply(x[..., :d]), x[..., d:]), dim=-1)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        # SiLU(gate) * up has outlier channels that per-row int8 rounds badly (+1.1% vs +0.4%
        # perplexity with it on SmolLM2): bf16 at mid batches.
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, int8_activations=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"  # GeGLU (Gemma) instead of SwiGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        kernels = fused()
        if kernels is not None and not self.gelu:
            return self.down_proj(kernels.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


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
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = self.make_norm(cfg)
        self.rotary = rotary
        # Int8 rows before the logits cost +0.9% perplexity on SmolLM2: bf16 at mid batches.
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, int8_activations=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return LlamaDecoderLayer(cfg)

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        x = self.embed(input_ids)
        rotation = self.rotary.at(positions, x.dtype)  # shared by every layer
        window_meta = meta
        if self.config.sliding_window is not None and self.config.sliding_layers:
            window_meta = sliding_window_metadata(meta, self.config.sliding_window)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            sliding = self.config.window_of(i) is not None
            x = layer(x, rotation, window_meta if sliding else meta, cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
