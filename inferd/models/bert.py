"""BERT encoder (post-LayerNorm transformer with absolute positions), for sentence embeddings.

One forward pass over a padded batch::

    input_ids [B, T] --word + position + token type--> LayerNorm --> [B, T, H]
      x N layers:  x = LN(x + Wo·attn(Wqkv·x, mask))     (bidirectional; padded keys masked)
                   x = LN(x + W2·gelu(W1·x))
    -> last hidden state [B, T, H]

Weights come from a transformers-layout checkpoint (``embeddings.*``, ``encoder.layer.N.*``,
optionally under a ``bert.`` prefix; see ``loading/bert.py``); the pooler head is not used for
embeddings.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True, slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BertConfig:
        """From a transformers ``config.json``; ValueError says what is unsupported."""
        model_type = d.get("model_type")
        if model_type not in ("bert", None):
            raise ValueError(f"model_type {model_type!r} is not a BERT model")
        position = d.get("position_embedding_type", "absolute")
        if position != "absolute":
            raise ValueError(f"position_embedding_type {position!r} is not supported")
        act = d.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported")
        try:
            cfg = cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=int(d["num_attention_heads"]),
                intermediate_size=int(d["intermediate_size"]),
                max_position=int(d.get("max_position_embeddings", 512)),
                type_vocab_size=int(d.get("type_vocab_size", 2)),
                layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
                hidden_act=act,
                pad_token_id=int(d.get("pad_token_id", 0)),
            )
        except KeyError as exc:
            raise ValueError(f"config.json lacks {exc.args[0]!r}") from None
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        return cfg

    @classmethod
    def from_file(cls, path: Path) -> BertConfig:
        return cls.from_dict(json.loads(path.read_text()))


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.max_position, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word(input_ids) + self.token_type(token_type_ids) + self.position(positions)
        return self.norm(x)  # [B, T, H]


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(h, 3 * h)  # query, key and value fused
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(h, cfg.intermediate_size)
        self.ffn_out = nn.Linear(cfg.intermediate_size, h)
        self.ffn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        # [B, T, 3H] -> 3 x [B, heads, T, head_dim]
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        attn = attn.transpose(1, 2).reshape(b, t, h)
        x = self.attn_norm(x + self.attn_out(attn))
        return self.ffn_norm(x + self.ffn_out(self.act(self.ffn_in(x))))


class BertModel(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``input_ids`` and ``attention_mask`` (1 = token, 0 = padding) are [B, T]; returns the
        last hidden state [B, T, H]. Padded positions are never attended to."""
        x = self.embeddings(input_ids, torch.zeros_like(input_ids))
        # [B, 1, 1, T]: True where a key may be attended to (every query row keeps >= 1 key)
        mask = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return x
