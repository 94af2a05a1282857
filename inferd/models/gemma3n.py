"""Gemma 3n (text): Gemma 4's layer parts around AltUp streams, with a Laurel branch and
sparse MLP gates.

From Gemma 4 (models/gemma4.py) it keeps: norms scaling by ``w`` in float32; unscaled
attention over per-head-normed q and k and weightless-normed values; K/V sharing by the last
layers; per-layer embeddings (PLE) gating a branch after each layer; soft-capped logits.
What Gemma 3n adds:

- AltUp: the model carries ``altup_inputs`` streams of the hidden state (the embeddings, and
  learned projections of them rescaled to their magnitude). Before each layer a router reads
  the active stream and mixes all of them into predictions; the layer runs on the active
  prediction only; after it, each prediction is corrected by the layer's innovation (its
  output minus the active prediction) times a routed coefficient. At the end the other
  streams are projected back, rescaled, and all are averaged;
- Laurel: a low-rank residual branch (``hidden -> rank -> hidden``, normed) over the layer's
  normed input, averaged with the attention's output (a ``1/sqrt 2`` sum);
- the MLP width differs per layer (MatFormer slices cut it: loading/matformer.py), and the
  first layers keep only their gate's top activations: the cut-off is the gate's mean plus
  ``icdf(sparsity)`` of its standard deviation, the gate shifted by it and clipped at zero;
- the PLE branch reads the corrected active stream (scaled) and adds to the other streams;
  there is no per-layer output scalar;
- PLE ids past the narrow table (the media soft tokens' ids) read its row 0;
- in a ConditionalGeneration checkpoint the ids of the image and audio ranges (their markers
  and soft tokens) are embedded by those encoders' own tables (``MediaTokenEmbedder``), which
  also project the served encoders' rows (models/gemma3n_multimodal.py);
- the PLE's constant scales are rounded to the model's dtype first, as transformers' are.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from inferd.kernels.ops import Rotation
from inferd.layers.attention import AttentionMetadata, sliding_window_metadata
from inferd.layers.embedding import Embedding
from inferd.layers.linear import Linear
from inferd.layers.norm import RMSNorm
from inferd.layers.rotary import RotaryEmbedding
from inferd.models.config import Gemma3nLayers, Gemma3nMediaVocab, ModelConfig, ModelConfigError
from inferd.models.gemma4 import Gemma4Attention, Gemma4ForCausalLM, Gemma4RMSNorm, unit_rms
from inferd.models.llama import KVCache, LlamaMLP


def _layers_of(cfg: ModelConfig) -> Gemma3nLayers:
    if cfg.gemma3n is None:
        raise ModelConfigError(f"{cfg.architecture} is not a Gemma 3n config")
    return cfg.gemma3n


def gaussian_cutoff_multiplier(sparsity: float) -> float:
    """How many standard deviations above the mean a gate's cut-off lies for ``sparsity`` of
    a normal distribution below it (its inverse CDF, computed in float32 as the reference;
    on the CPU whatever device the model is being built on)."""
    p = torch.tensor(sparsity, dtype=torch.float32, device="cpu")
    return float(torch.erfinv(2 * p - 1) * math.sqrt(2))


class Gemma3nMLP(LlamaMLP):
    """GeGLU at this layer's width; with ``sparsity`` its gate keeps only what lies above a
    gaussian cut-off (each row's own mean and standard deviation)."""

    def __init__(self, cfg: ModelConfig, width: int, sparsity: float) -> None:
        super().__init__(replace(cfg, intermediate_size=width))
        self.width = width
        self.multiplier = gaussian_cutoff_multiplier(sparsity) if sparsity > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.multiplier is None:
            return super().forward(x)
        gate_up = self.gate_up_proj.forward(x)
        gate, up = gate_up[:, : self.width], gate_up[:, self.width :]
        multiplier = torch.tensor(self.multiplier, dtype=gate.dtype)
        spread = torch.std(gate, dim=-1, keepdim=True, correction=0)
        gate = F.relu(gate - (gate.mean(-1, keepdim=True) + spread * multiplier))
        return self.down_proj.forward(F.gelu(gate, approximate="tanh") * up)


class AltUp(nn.Module):
    """One layer's predict and correct steps over the streams ``[streams, tokens, hidden]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        g = _layers_of(cfg)
        k, size = g.altup_inputs, cfg.hidden_size
        self.active = g.altup_active
        self.correct_output_scale = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.correction_coefs = Linear(k, k)
        self.prediction_coefs = Linear(k, k * k)
        self.modality_router = Linear(size, k)
        self.router_norm = Gemma4RMSNorm(size, cfg.rms_norm_eps)
        self.router_scale = 1.0 / size

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """Each token's routing weights [tokens, streams], in -1..1."""
        routed = self.modality_router.forward(self.router_norm.forward(x) * self.router_scale)
        return torch.tanh(routed.float()).to(x.dtype)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """Each stream plus a routed mix of all of them: ``p[j] = s[j] + sum_i c[j, i] s[i]``."""
        k, n = streams.shape[0], streams.shape[1]
        coefs = self.prediction_coefs.forward(self.route(streams[self.active])).view(n, k, k)
        return torch.einsum("nji,ind->jnd", coefs, streams) + streams

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """Each prediction moved by the layer's innovation times its routed coefficient (plus
        one)."""
        innovation = activated - predictions[self.active]
        coefs = self.correction_coefs.forward(self.route(activated)) + 1.0  # [tokens, streams]
        return innovation.unsqueeze(0) * coefs.t().unsqueeze(-1) + predictions


class Laurel(nn.Module):
    """The learned augmented residual: ``x + norm(right(left(x)))`` through a low rank."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        rank = _layers_of(cfg).laurel_rank
        self.linear_left = Linear(cfg.hidden_size, rank)
        self.linear_right = Linear(rank, cfg.hidden_size)
        self.post_laurel_norm = Gemma4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = self.linear_right.forward(self.linear_left.forward(x))
        return x + self.post_laurel_norm.forward(low)


class MediaTokenEmbedder(nn.Module):
    """The embeddings of one media vocabulary range (``Gemma3nMediaVocab``): its own table,
    normed, projected to the text width, normed again without a weight (``embed_ids``). With
    ``soft``, its encoder's rows take the same way through a norm of their own
    (``embed_soft``: transformers' Gemma3nMultimodalEmbedder on ``inputs_embeds``)."""

    def __init__(self, cfg: ModelConfig, vocab: Gemma3nMediaVocab, soft: bool = False) -> None:
        super().__init__()
        self.offset, self.size, self.eps = vocab.offset, vocab.size, vocab.rms_norm_eps
        self.embedding = Embedding(vocab.size, vocab.hidden_size)
        self.hard_embedding_norm = Gemma4RMSNorm(vocab.hidden_size, vocab.rms_norm_eps)
        if soft:
            self.soft_embedding_norm = Gemma4RMSNorm(vocab.hidden_size, vocab.rms_norm_eps)
        self.embedding_projection = Linear(vocab.hidden_size, cfg.hidden_size)

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ids of this range."""
        rows = self.hard_embedding_norm.forward(self.embedding(ids - self.offset))
        return unit_rms(self.embedding_projection.forward(rows), self.eps)

    def embed_soft(self, rows: torch.Tensor) -> torch.Tensor:
        """The encoder's rows [n, encoder width] in the text model's width."""
        rows = self.soft_embedding_norm.forward(rows)
        return unit_rms(self.embedding_projection.forward(rows), self.eps)

    def overlay(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x`` with the rows of this range's ids replaced by their embeddings."""
        inside = (input_ids >= self.offset) & (input_ids < self.offset + self.size)
        if not bool(inside.any()):
            return x
        out = x.clone()
        out[inside] = self.embed_ids(input_ids[inside]).to(x.dtype)
        return out


class Gemma3nDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        g, shared = _layers_of(cfg), cfg.gemma4
        assert shared is not None
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.active = g.altup_active
        self.correct_scale = g.altup_correct_scale
        self.altup = AltUp(cfg)
        self.laurel = Laurel(cfg)
        self.input_norm = Gemma4RMSNorm(size, eps)
        self.self_attn = Gemma4Attention(cfg, layer)
        self.post_attention_norm = Gemma4RMSNorm(size, eps)
        self.pre_feedforward_norm = Gemma4RMSNorm(size, eps)
        self.mlp = Gemma3nMLP(cfg, g.intermediate_sizes[layer], g.sparsity[layer])
        self.post_feedforward_norm = Gemma4RMSNorm(size, eps)
        self.per_layer_input_gate = Linear(size, shared.per_layer_size)
        self.per_layer_projection = Linear(shared.per_layer_size, size)
        self.post_per_layer_input_norm = Gemma4RMSNorm(size, eps)

    def forward(
        self,
        streams: torch.Tensor,
        per_layer: torch.Tensor,
        rotation: Rotation,
        meta: AttentionMetadata,
        cache: KVCache,
    ) -> torch.Tensor:
        """The layer on ``streams`` [streams, n, hidden]; ``per_layer``: its PLE rows."""
        predictions = self.altup.predict(streams)
        active = predictions[self.active]
        normed = self.input_norm.forward(active)
        laurel = self.laurel.forward(normed)
        attn = self.post_attention_norm.forward(
            self.self_attn.forward(normed, rotation, meta, cache)
        )
        x = (active + attn + laurel) / math.sqrt(2)
        h = self.mlp.forward(self.pre_feedforward_norm.forward(x))
        x = x + self.post_feedforward_norm.forward(h)
        corrected = self.altup.correct(predictions, x)
        first = corrected[self.active]
        if self.correct_scale:
            first = first * self.altup.correct_output_scale
        gate = F.gelu(self.per_layer_input_gate.forward(first), approximate="tanh")
        branch = self.post_per_layer_input_norm.forward(
            self.per_layer_projection.forward(gate * per_layer)
        )
        # The reference adds the branch to streams 1.. whichever stream is active.
        return torch.cat((corrected[:1], corrected[1:] + branch))


def _rescaled(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``x`` scaled to the root-mean-square ``target`` (its own floored at 1e-5 squared)."""
    magnitude = torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))
    return x * target / magnitude


class Gemma3nForCausalLM(Gemma4ForCausalLM):
    """Gemma 3n's decoder, layer by layer over its AltUp streams (no decode stack).

    ``rotary`` (global layers) and ``local_rotary`` (sliding ones) are set by the loader, as
    Gemma 4's (``gemma4_rotaries``: one head size, every channel rotating)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, rotary)
        g = _layers_of(cfg)
        size = cfg.hidden_size
        others = range(1, g.altup_inputs)
        self.altup_projections = nn.ModuleList(Linear(size, size) for _ in others)
        self.altup_unembed_projections = nn.ModuleList(Linear(size, size) for _ in others)
        served = {"embed_audio": cfg.gemma3n_audio, "embed_vision": cfg.gemma3n_vision}
        for vocab in g.media_vocab:  # embed_vision, embed_audio (whose encoders may be served)
            soft = served.get(vocab.name) is not None
            setattr(self, vocab.name, MediaTokenEmbedder(cfg, vocab, soft))
        self.media_vocab = tuple(vocab.name for vocab in g.media_vocab)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The text embedding, scaled; the ids of a media range (a ConditionalGeneration
        checkpoint's image and audio markers) from that encoder's own table instead."""
        x = super().embed(input_ids)
        for name in self.media_vocab:
            x = getattr(self, name).overlay(input_ids, x)
        return x

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return Gemma3nDecoderLayer(cfg, layer)

    def make_norm(self, cfg: ModelConfig) -> RMSNorm:
        return Gemma4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def lora_target(self, layer: int, name: str) -> tuple[Linear, int, int]:
        raise ModelConfigError("LoRA adapters on gemma3n models are not supported yet")

    def ple_scale(self, value: float, dtype: torch.dtype) -> float | torch.Tensor:
        return torch.tensor(value, dtype=dtype)  # transformers' buffers, cast to the dtype

    def ple_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        shared = self.config.gemma4
        assert shared is not None
        outside = (input_ids < 0) | (input_ids >= shared.per_layer_vocab)
        return torch.where(outside, 0, input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids) if embeds is None else embeds
        per_layer = self.per_layer_inputs(input_ids, x)
        target = torch.mean(x**2, dim=-1, keepdim=True) ** 0.5
        streams = [x, *(_rescaled(p.forward(x), target) for p in self.altup_projections)]
        hidden = torch.stack(streams)
        global_rotation = self.rotary.at(positions, x.dtype)
        local_rotation = self.local_rotary.at(positions, x.dtype)
        window = self.config.sliding_window
        window_meta = sliding_window_metadata(meta, window) if window is not None else meta
        for i, layer in enumerate(self.layers):
            sliding = self.sliding[i]
            hidden = layer(
                hidden,
                per_layer[:, i],
                local_rotation if sliding else global_rotation,
                window_meta if sliding else meta,
                kv_caches[self.kv_sources[i]],
            )
        target = torch.mean(hidden[0] ** 2, dim=-1, keepdim=True) ** 0.5
        back = (
            _rescaled(p.forward(s), target)
            for p, s in zip(self.altup_unembed_projections, hidden[1:], strict=True)
        )
        return self.norm.forward(torch.stack([hidden[0], *back]).mean(0))
