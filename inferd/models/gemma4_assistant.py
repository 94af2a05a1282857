"""Gemma 4's drafting assistant (``gemma4_assistant``): a few Gemma 4 layers that propose the
served Gemma 4's next tokens from its own state (multi-token prediction).

Every layer of the assistant shares keys and values: it computes queries only and attends to
the served model's cache, its sliding layers to the last sliding layer that writes a cache,
its global layers to the last global one (``target_sources``). A draft step takes one row, the
served model's scaled embedding of the last token beside a hidden state (the served model's
final, normed one for the first draft; the assistant's own projected one after), projects it
down (``pre_projection``), runs the layers at the position of that last token, and gives the
logits of the next token and the hidden state for the step after (``post_projection``). The
position stays the same for every draft of a round, as transformers' candidate generator has it.

The logits are its tied head's, not soft-capped; with ``use_ordered_embeddings`` only the tokens
of the ``centroid_intermediate_top_k`` clusters its centroids score highest get logits, the
others the least of those less one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from inferd.kernels.ops import Rotation
from inferd.layers.attention import AttentionMetadata
from inferd.layers.linear import Linear
from inferd.layers.rotary import RotaryEmbedding
from inferd.models.config import ModelConfig, ModelConfigError, config_from_hf
from inferd.models.gemma4 import Gemma4ForCausalLM
from inferd.models.llama import KVCache

ARCHITECTURE = "gemma4_assistant"


@dataclass(frozen=True, slots=True)
class AssistantConfig:
    text: ModelConfig  # its layers (every one K/V-sharing), head and embedding
    backbone_hidden_size: int  # the served model's hidden size
    ordered_embeddings: bool
    num_centroids: int
    centroid_top_k: int

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> AssistantConfig:
        text = hf.get("text_config")
        if hf.get("model_type") != ARCHITECTURE or not isinstance(text, Mapping):
            raise ModelConfigError(f"not a {ARCHITECTURE} config")
        cfg = config_from_hf(dict(text), has_lm_head=False)
        g = cfg.gemma4
        if g is None or g.kv_shared_layers != cfg.num_layers or g.per_layer_size:
            raise ModelConfigError(
                f"a {ARCHITECTURE} shares keys and values in every layer and has no per-layer "
                "embeddings"
            )
        made = cls(
            cfg,
            int(hf.get("backbone_hidden_size") or 1536),
            bool(hf.get("use_ordered_embeddings")),
            int(hf.get("num_centroids") or 2048),
            int(hf.get("centroid_intermediate_top_k") or 32),
        )
        if made.ordered_embeddings and cfg.vocab_size % made.num_centroids:
            raise ModelConfigError(
                f"{cfg.vocab_size} tokens do not split into {made.num_centroids} centroids"
            )
        return made


def target_sources(target: ModelConfig) -> dict[bool, int]:
    """The served model's layer whose cache the assistant's sliding (True) and global (False)
    layers read: the last layer of that kind that writes a cache of its own."""
    sources: dict[bool, int] = {}
    for layer in range(target.num_layers):
        if target.kv_source(layer) == layer:
            sources[target.window_of(layer) is not None] = layer
    return sources


class Gemma4AssistantForCausalLM(Gemma4ForCausalLM):
    """The assistant's layers, norm and tied head (a Gemma 4 decoder of K/V-sharing layers)
    with its projections in and out, and the centroids of its ordered head."""

    def __init__(self, cfg: AssistantConfig, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg.text, rotary)
        hidden = cfg.text.hidden_size
        self.assistant = cfg
        self.pre_projection = Linear(2 * cfg.backbone_hidden_size, hidden)
        self.post_projection = Linear(hidden, cfg.backbone_hidden_size)
        self.centroids: Linear | None = None
        self.token_ordering: torch.Tensor  # the ordered head's token ids, cluster by cluster
        if cfg.ordered_embeddings:
            self.centroids = Linear(hidden, cfg.num_centroids)
            self.register_buffer(
                "token_ordering", torch.zeros(cfg.text.vocab_size, dtype=torch.long)
            )

    def draft(
        self,
        x: torch.Tensor,
        rotations: tuple[Rotation, Rotation],
        metas: tuple[AttentionMetadata, AttentionMetadata],
        caches: Mapping[bool, KVCache],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [n, 2 * backbone] (embedding, hidden) -> the next token's logits [n, vocab] and
        the hidden state [n, backbone] for the next draft. ``rotations`` and ``metas``: the
        (global, sliding) layers' at the rows' position; ``caches``: the served model's, by
        ``target_sources``' kinds."""
        h = self.pre_projection.forward(x)
        for i, layer in enumerate(self.layers):
            sliding = self.sliding[i]
            h = layer(h, None, rotations[sliding], metas[sliding], caches[sliding])
        h = self.norm.forward(h)
        return self._head(h), self.post_projection.forward(h)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight  # the tied head's
        if self.centroids is None:
            logits: torch.Tensor = h @ weight.to(h.dtype).T
            return logits
        cfg = self.assistant
        per_centroid = cfg.text.vocab_size // cfg.num_centroids
        top = self.centroids.forward(h).topk(cfg.centroid_top_k, dim=-1).indices
        clusters = self.token_ordering.view(cfg.num_centroids, per_centroid)
        chosen = clusters[top].flatten(1)  # [n, top_k * per_centroid] token ids
        picked = (weight[chosen].to(h.dtype) @ h.unsqueeze(-1)).squeeze(-1)
        out = torch.full((h.shape[0], cfg.text.vocab_size), float(picked.min()) - 1.0)
        return out.to(h.dtype).scatter_(-1, chosen, picked)
