"""Gemma 4 (text): Gemma 3's sandwich-normed GeGLU decoder with what Gemma 4 changes.

- norms scale by ``w`` (not Gemma 3's ``1 + w``), in float32, rounded once;
- attention is unscaled: q and k are RMS-normed per head, and so are the values (no weight);
- global layers have their own head size and key/value heads (``ModelConfig.kv_shape``) and
  rotate only the first ``global_rotary_fraction`` of each head's channel pairs with
  ``rope_theta`` ("proportional" RoPE: the other pairs turn at frequency zero); sliding layers
  rotate every channel with ``rope_local_theta``;
- with ``k_eq_v`` a global layer has no value projection: its values are the keys'
  projection (normed as values, never rotated);
- the last ``kv_shared_layers`` layers compute no keys or values: each attends to the cache
  of the last earlier layer of its kind (``ModelConfig.kv_source``), and with
  ``double_wide_mlp`` their MLPs are twice as wide;
- per-layer embeddings (PLE): a second, narrow embedding of the token ids plus a projection
  of the input embeddings give each layer a small vector, which gates a residual branch after
  its MLP (a media placeholder's ids count as padding there);
- each layer's output is multiplied by a learned scalar; the logits are soft-capped;
- with ``enable_moe_block`` (26B-A4B) each layer adds a mixture of experts beside its dense
  MLP: the router reads the MLP's input before its norm (normed without a weight, scaled per
  channel), the experts read it under a norm of their own, and the two outputs, each normed,
  are summed before the layer's post-MLP norm; the routing weights are scaled per expert.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from inferd.kernels.ops import Rotation
from inferd.layers.attention import AttentionMetadata, attend_paged, sliding_window_metadata
from inferd.layers.embedding import Embedding
from inferd.layers.kernel_user import KernelUser
from inferd.layers.linear import Linear
from inferd.layers.moe import Experts, top_k_routing
from inferd.layers.norm import RMSNorm
from inferd.layers.rotary import RotaryEmbedding
from inferd.models.config import Gemma4Layers, ModelConfig, ModelConfigError, MoeConfig
from inferd.models.gemma import Gemma2ForCausalLM
from inferd.models.llama import KVCache, LlamaMLP


class Gemma4RMSNorm(RMSNorm):
    """``(x / rms(x)) * w`` computed in float32 and rounded once, as Gemma 4 does (the shared
    kernel rounds before scaling, which differs in 16-bit dtypes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dimension in float32 (Gemma 4's weightless value norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def proportional_inv_freq(head_dim: int, base: float, fraction: float) -> torch.Tensor:
    """Inverse frequencies of a head of ``head_dim`` channels of which the first ``fraction``
    of pairs rotate (exponents over the whole head, as if all did); the rest get zero, so a
    full-width rotary table leaves them as they are."""
    pairs = int(fraction * head_dim // 2)
    exponents = torch.arange(0, 2 * pairs, 2, dtype=torch.float64) / head_dim
    inv = torch.zeros(head_dim // 2, dtype=torch.float64)
    inv[:pairs] = 1.0 / base**exponents
    return inv.float()


def gemma4_rotaries(cfg: ModelConfig, rows: int) -> tuple[RotaryEmbedding, RotaryEmbedding]:
    """(global, sliding) rotary tables of ``rows`` positions: each as wide as its layers'
    heads."""
    g = _layers_of(cfg)
    global_inv = proportional_inv_freq(g.global_head_dim, cfg.rope_theta, g.global_rotary_fraction)
    local_theta = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    local_inv = proportional_inv_freq(cfg.head_dim, local_theta, 1.0)
    return (
        RotaryEmbedding(g.global_head_dim, rows, global_inv),
        RotaryEmbedding(cfg.head_dim, rows, local_inv),
    )


def _layers_of(cfg: ModelConfig) -> Gemma4Layers:
    if cfg.gemma4 is None:
        raise ModelConfigError(f"{cfg.architecture} is not a Gemma 4 config")
    return cfg.gemma4


class Gemma4Attention(nn.Module, KernelUser):
    """One layer's attention at its own shape; a K/V-sharing layer has only q and o."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        g = _layers_of(cfg)
        self.num_heads = cfg.num_heads
        self.num_kv_heads, self.head_dim = cfg.kv_shape(layer)
        self.owns_kv = cfg.kv_source(layer) == layer
        self.values_are_keys = g.k_eq_v and cfg.window_of(layer) is None
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        width = self.q_size
        if self.owns_kv:
            width += self.kv_size * (1 if self.values_are_keys else 2)
        self.qkv_proj = Linear(cfg.hidden_size, width)  # [q | k | v], or [q | k], or q
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.eps = cfg.rms_norm_eps
        self.q_norm = Gemma4RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = Gemma4RMSNorm(self.head_dim, cfg.rms_norm_eps) if self.owns_kv else None

    def forward(
        self, x: torch.Tensor, rotation: Rotation, meta: AttentionMetadata, cache: KVCache
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        q = self.q_norm.forward(qkv[:, : self.q_size].view(n, self.num_heads, self.head_dim))
        k_cache, v_cache = cache
        if self.k_norm is None:  # the source layer wrote this step's keys already
            q = rotation.apply(q)
        else:
            k = qkv[:, self.q_size : self.q_size + self.kv_size]
            v = k if self.values_are_keys else qkv[:, self.q_size + self.kv_size :]
            k = self.k_norm.forward(k.view(n, self.num_kv_heads, self.head_dim))
            v = unit_rms(v.view(n, self.num_kv_heads, self.head_dim), self.eps)
            rows = torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=1)
            q = self.ops.rope_write_kv(
                rows, rotation, meta.slot_mapping, k_cache, v_cache, self.num_heads
            )
        out = attend_paged(self.ops, q, k_cache, v_cache, meta, 1.0)
        return self.o_proj.forward(out.reshape(n, self.q_size))


class Gemma4Router(nn.Module):
    """Gemma 4's router: the residual stream normed (no weight), scaled per channel and by
    ``1 / sqrt(hidden)``, to expert logits; the top-k weights (float32) scaled per expert."""

    def __init__(self, cfg: ModelConfig, moe: MoeConfig) -> None:
        super().__init__()
        self.eps, self.top_k = cfg.rms_norm_eps, moe.top_k
        self.root = cfg.hidden_size**-0.5
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        # torch's Linear, not ours: ISQ and the packed kernels leave the router dense.
        self.proj = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.per_expert_scale = nn.Parameter(torch.ones(moe.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.proj(unit_rms(x, self.eps) * self.scale * self.root)
        weights, experts = top_k_routing(logits, self.top_k)
        return weights * self.per_expert_scale[experts], experts


class Gemma4MoE(nn.Module):
    """The experts beside a layer's dense MLP, with their router and norms."""

    def __init__(self, cfg: ModelConfig, moe: MoeConfig) -> None:
        super().__init__()
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.router = Gemma4Router(cfg, moe)
        self.experts = Experts(moe.num_experts, size, moe.intermediate_size, gelu=True)
        self.pre_norm = Gemma4RMSNorm(size, eps)
        self.post_norm = Gemma4RMSNorm(size, eps)
        self.mlp_post_norm = Gemma4RMSNorm(size, eps)  # the dense MLP's output's

    def forward(self, x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """The MLP's output on ``x`` given the dense MLP's (``dense``)."""
        moe = self.experts(self.pre_norm.forward(x), *self.router(x))
        return self.mlp_post_norm.forward(dense) + self.post_norm.forward(moe)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        g = _layers_of(cfg)
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_norm = Gemma4RMSNorm(size, eps)
        self.self_attn = Gemma4Attention(cfg, layer)
        self.post_attention_norm = Gemma4RMSNorm(size, eps)
        self.pre_feedforward_norm = Gemma4RMSNorm(size, eps)
        wide = g.double_wide_mlp and cfg.kv_source(layer) != layer
        mlp_cfg = replace(cfg, intermediate_size=cfg.intermediate_size * (2 if wide else 1))
        self.mlp = LlamaMLP(mlp_cfg)
        self.moe = Gemma4MoE(cfg, cfg.moe) if cfg.moe is not None else None
        self.post_feedforward_norm = Gemma4RMSNorm(size, eps)
        self.per_layer_input_gate: Linear | None = None
        if g.per_layer_size:
            self.per_layer_input_gate = Linear(size, g.per_layer_size)
            self.per_layer_projection = Linear(g.per_layer_size, size)
            self.post_per_layer_input_norm = Gemma4RMSNorm(size, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,
        per_layer: torch.Tensor | None,
        rotation: Rotation,
        meta: AttentionMetadata,
        cache: KVCache,
    ) -> torch.Tensor:
        """The layer on ``x``; ``per_layer``: this layer's PLE rows [n, per_layer_size]."""
        h = self.self_attn.forward(self.input_norm.forward(x), rotation, meta, cache)
        x = x + self.post_attention_norm.forward(h)
        h = self.mlp.forward(self.pre_feedforward_norm.forward(x))
        if self.moe is not None:
            h = self.moe(x, h)
        x = x + self.post_feedforward_norm.forward(h)
        if self.per_layer_input_gate is not None and per_layer is not None:
            gate = F.gelu(self.per_layer_input_gate.forward(x), approximate="tanh")
            h = self.per_layer_projection.forward(gate * per_layer)
            x = x + self.post_per_layer_input_norm.forward(h)
        return x * self.layer_scalar


def causal_only(meta: AttentionMetadata) -> AttentionMetadata:
    """``meta`` without its chunks' bidirectional spans (Gemma 4's global layers stay causal
    over an image's tokens)."""
    if not any(chunk.bidirectional for chunk in meta.prefills):
        return meta
    chunks = tuple(dataclasses.replace(chunk, bidirectional=()) for chunk in meta.prefills)
    return dataclasses.replace(meta, prefills=chunks)


class Gemma4ForCausalLM(Gemma2ForCausalLM):
    """Gemma 4's decoder, layer by layer (the decode stack takes no layer of this shape).

    ``rotary`` (global layers) and ``local_rotary`` (sliding ones) are set by the loader
    (``loading/weights.build_empty``, from ``gemma4_rotaries``)."""

    stack_enabled = False

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, rotary)
        g = _layers_of(cfg)
        self.local_rotary = rotary
        self.kv_sources = tuple(cfg.kv_source(i) for i in range(cfg.num_layers))
        # Ids whose PLE row is padding's: media placeholders (their rows come from an encoder).
        self.placeholder_ids = tuple(
            t for m in ("image", "video", "audio") if (t := cfg.placeholder_token(m)) is not None
        )
        self.embed_tokens_per_layer: Embedding | None = None
        if g.per_layer_size:
            width = cfg.num_layers * g.per_layer_size
            self.embed_tokens_per_layer = Embedding(g.per_layer_vocab, width)
            self.per_layer_model_projection = Linear(cfg.hidden_size, width)
            self.per_layer_projection_norm = Gemma4RMSNorm(g.per_layer_size, cfg.rms_norm_eps)

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return Gemma4DecoderLayer(cfg, layer)

    def make_norm(self, cfg: ModelConfig) -> RMSNorm:
        return Gemma4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def layer_rotaries(self) -> tuple[RotaryEmbedding, ...] | None:
        return None  # layers of two head sizes: no decode stack

    def lora_target(self, layer: int, name: str) -> tuple[Linear, int, int]:
        # The fused projections differ per layer (no v in k_eq_v layers, q alone in sharing
        # ones): the Llama mapping would put an adapter's update in the wrong columns.
        raise ModelConfigError("LoRA adapters on gemma4 models are not supported yet")

    def ple_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids whose rows the PLE table gives: a media placeholder reads padding's."""
        pad = _layers_of(self.config).pad_token_id
        for token in self.placeholder_ids:
            input_ids = torch.where(input_ids == token, pad, input_ids)
        return input_ids

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Each token's PLE rows [n, layers, per_layer_size]: the ids' narrow embedding plus
        the normed projection of the input embeddings (media rows included), over sqrt 2."""
        table = self.embed_tokens_per_layer
        assert table is not None
        g = _layers_of(self.config)
        dtype = embeds.dtype
        shape = (input_ids.shape[0], self.config.num_layers, g.per_layer_size)
        by_id = table(self.ple_ids(input_ids)) * torch.tensor(g.per_layer_size**0.5, dtype=dtype)
        scale = self.ple_scale(self.config.hidden_size**-0.5, dtype)
        projected = self.per_layer_model_projection.forward(embeds) * scale
        projected = self.per_layer_projection_norm.forward(projected.view(shape))
        return (projected + by_id.view(shape)) * self.ple_scale(2**-0.5, dtype)

    def ple_scale(self, value: float, dtype: torch.dtype) -> float | torch.Tensor:
        """A constant the PLE rows are scaled by, as the reference multiplies: Gemma 4 by the
        exact number (Gemma 3n rounds it to the model's dtype first)."""
        return value

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids) if embeds is None else embeds
        per_layer = None
        if self.embed_tokens_per_layer is not None:
            per_layer = self.per_layer_inputs(input_ids, x)
        global_rotation = self.rotary.at(positions, x.dtype)
        local_rotation = self.local_rotary.at(positions, x.dtype)
        window = self.config.sliding_window
        window_meta = sliding_window_metadata(meta, window) if window is not None else meta
        meta = causal_only(meta)  # media tokens see each other both ways on sliding layers only
        for i, layer in enumerate(self.layers):
            sliding = self.sliding[i]
            x = layer(
                x,
                None if per_layer is None else per_layer[:, i],
                local_rotation if sliding else global_rotation,
                window_meta if sliding else meta,
                kv_caches[self.kv_sources[i]],
            )
        return self.norm.forward(x)
