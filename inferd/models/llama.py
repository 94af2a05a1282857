"""Llama-family decoder (Llama, Mistral, SmolLM): RMSNorm, RoPE, grouped-query attention, SwiGLU.

Projections are fused (one QKV matmul, one gate+up matmul) to cut per-layer kernel launches.
``forward`` takes a flat batch of tokens from many requests; attention metadata says which
rows belong to whom and where their KV lives.

The same decoder runs the close relatives, switched by ``ModelConfig`` fields: Qwen2 (q/k/v
biases), Qwen3 (per-head q/k RMSNorm), Mistral (sliding window), Phi-3 (partial rotary; its fused
checkpoint tensors are a loader matter). Gemma 2 and 3 subclass it (models/gemma.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from inferd.kernels.ops import KernelOps, Rotation, StackKernel
from inferd.layers.attention import AttentionMetadata, attend_paged, sliding_window_metadata
from inferd.layers.embedding import Embedding
from inferd.layers.kernel_user import KernelUser
from inferd.layers.linear import Linear
from inferd.layers.moe import SparseMoeBlock
from inferd.layers.norm import RMSNorm
from inferd.layers.registered import Registered
from inferd.layers.rotary import RotaryEmbedding
from inferd.models.config import ModelConfig, ModelConfigError
from inferd.models.decode_stack import DecodeStack, KVCache, shared_norm, stack_projection


class LlamaAttention(nn.Module, KernelUser):
    # Read straight from the registry on the hot path (layers/registered.py)
    qkv_proj = Registered[Linear]()
    o_proj = Registered[Linear]()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.attention_scale or cfg.head_dim**-0.5
        self.softcap = cfg.attn_softcap

    def forward(
        self, x: torch.Tensor, rotation: Rotation, meta: AttentionMetadata, cache: KVCache
    ) -> torch.Tensor:
        # The hot submodules' ``forward`` is called directly: ``nn.Module.__call__`` costs
        # ~1.5 us a call (hooks, which inferd does not use), ~270 calls a decode step.
        qkv = self.qkv_proj.forward(x)
        if self.q_norm is not None and self.k_norm is not None:
            qkv = self._norm_qk(qkv, self.q_norm, self.k_norm)
        k_cache, v_cache = cache
        q = self.ops.rope_write_kv(
            qkv, rotation, meta.slot_mapping, k_cache, v_cache, self.num_heads
        )
        out = attend_paged(self.ops, q, k_cache, v_cache, meta, self.scale, softcap=self.softcap)
        return self.o_proj.forward(out.reshape(-1, self.q_size))

    def _norm_qk(self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm) -> torch.Tensor:
        """Per-head RMSNorm of q and k (Qwen3, Gemma 3), before the rotation."""
        return self.ops.qk_rms_norm(
            qkv,
            q_norm.weight,
            k_norm.weight,
            self.num_heads,
            self.num_kv_heads,
            q_norm.eps,
            q_norm.unit_offset,
        )


class LlamaMLP(nn.Module, KernelUser):
    gate_up_proj = Registered[Linear]()  # read straight from the registry (layers/registered.py)
    down_proj = Registered[Linear]()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.gelu = cfg.hidden_act == "gelu_tanh"  # GeGLU (Gemma) instead of SwiGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)  # forward, not __call__: LlamaAttention.forward
        act = self.ops.gelu_tanh_mul(gate_up) if self.gelu else self.ops.silu_mul(gate_up)
        return self.down_proj.forward(act)


def make_mlp(cfg: ModelConfig, layer: int) -> LlamaMLP | SparseMoeBlock:
    """A decoder layer's MLP: a mixture of experts where ``cfg.moe`` names the layer
    (Qwen3-VL-MoE's), else dense."""
    moe = cfg.moe
    if moe is None or layer not in moe.layers:
        return LlamaMLP(cfg)
    gelu = cfg.hidden_act == "gelu_tanh"
    return SparseMoeBlock(cfg.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size, gelu)


class SplitResidualLayer(nn.Module):
    """A decoder layer whose output stays a pair (residual, delta) on the model's hot path, so
    the next norm does the add (``forward_split``); ``forward`` adds them for other callers (a
    self-speculation draft running the first layers)."""

    def forward(
        self, x: torch.Tensor, rotation: Rotation, meta: AttentionMetadata, cache: KVCache
    ) -> torch.Tensor:
        x, delta = self.forward_split(x, None, rotation, meta, cache)
        return x + delta

    def forward_split(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        rotation: Rotation,
        meta: AttentionMetadata,
        cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def stack_layer(self, kernel: StackKernel, dtype: torch.dtype) -> Any | None:
        """The layer as ``decode_stack`` runs it (models/decode_stack.py), or None where it
        cannot: then the model runs layer by layer."""
        return None


def stack_layer(
    kernel: StackKernel,
    attn: LlamaAttention,
    mlp: LlamaMLP,
    norms: Mapping[str, RMSNorm],
    dtype: torch.dtype,
) -> Any | None:
    """A decoder layer's ``StackLayer``: its projections' VNNI copies, its attention's shape and
    its norms by the part they play (``input_norm`` and ``mlp_norm`` hold the residual adds;
    Gemma's ``attn_out_norm`` and ``mlp_out_norm`` norm a block's output); None where a part
    is one the stack does not take. The model sets ``window`` and ``rotation``."""
    layer = kernel.StackLayer()
    projections = {
        "qkv": attn.qkv_proj,
        "o": attn.o_proj,
        "gate_up": mlp.gate_up_proj,
        "down": mlp.down_proj,
    }
    for name, linear in projections.items():
        projection = stack_projection(kernel, linear)
        if projection is None:
            return None
        setattr(layer, name, projection)
    qk = [n for n in (attn.q_norm, attn.k_norm) if n is not None]
    shared = shared_norm([*norms.values(), *qk], dtype)
    if shared is None:
        return None
    layer.eps, layer.unit_offset = shared
    for role, norm in norms.items():
        setattr(layer, role, norm.weight)
    if attn.q_norm is not None and attn.k_norm is not None:
        layer.q_norm, layer.k_norm = attn.q_norm.weight, attn.k_norm.weight
    layer.gelu = mlp.gelu
    layer.heads, layer.kv_heads = attn.num_heads, attn.num_kv_heads
    layer.scale, layer.softcap = attn.scale, attn.softcap or 0.0
    return layer


class LlamaDecoderLayer(SplitResidualLayer):
    # Read straight from the registry on the hot path (layers/registered.py)
    input_norm = Registered[RMSNorm]()
    self_attn = Registered[LlamaAttention]()
    post_attention_norm = Registered[RMSNorm]()
    mlp = Registered[LlamaMLP | SparseMoeBlock]()

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = make_mlp(cfg, layer)

    def forward_split(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        rotation: Rotation,
        meta: AttentionMetadata,
        cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on ``x + delta`` (on ``x`` when ``delta`` is None), its output left as a
        pair (residual, delta) to add: each residual add runs inside the norm after it
        (``add_rms_norm``), the next layer's for the last one. Submodules' ``forward`` is called
        directly on this hot path (LlamaAttention.forward says why)."""
        x, h = self.input_norm.add_forward(x, delta)
        x, h = self.post_attention_norm.add_forward(
            x, self.self_attn.forward(h, rotation, meta, cache)
        )
        return x, self.mlp.forward(h)

    def stack_layer(self, kernel: StackKernel, dtype: torch.dtype) -> Any | None:
        if not isinstance(self.mlp, LlamaMLP):
            return None  # the stack has no experts
        norms = {"input_norm": self.input_norm, "mlp_norm": self.post_attention_norm}
        return stack_layer(kernel, self.self_attn, self.mlp, norms, dtype)


class LlamaForCausalLM(nn.Module, KernelUser):
    stack_enabled = True  # False: every step layer by layer (tests compare the two)

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.config = cfg
        self._stack: DecodeStack | None = None  # built at the first decode step
        self._stack_built = False
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        # Whether each layer attends through a sliding window (read every step).
        self.sliding = tuple(cfg.window_of(i) is not None for i in range(cfg.num_layers))
        self.norm = self.make_norm(cfg)
        self.rotary = rotary
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def use_kernels(self, ops: KernelOps) -> None:
        """Run every layer on ``ops`` (picked once, when the engine is assembled: ``load_ops``)."""
        for module in self.modules():
            if isinstance(module, KernelUser):
                module.ops = ops
        self._stack, self._stack_built = None, False  # rebuilt on these ops

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return LlamaDecoderLayer(cfg, layer)

    def make_norm(self, cfg: ModelConfig) -> RMSNorm:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size].
        ``embeds``: the input embeddings when the caller made them (``embed`` of the ids with
        an image encoder's rows written over its placeholder tokens)."""
        x = self.embed(input_ids) if embeds is None else embeds
        stacked = self.run_stack(x, positions, meta, kv_caches)
        if stacked is not None:
            return stacked
        rotation = self.rotation_at(positions, x.dtype)  # shared by every layer
        window_meta = meta
        if self.config.sliding_window is not None and self.config.sliding_layers:
            window_meta = sliding_window_metadata(meta, self.config.sliding_window)
        delta: torch.Tensor | None = None  # what a layer left to add (forward_split)
        layers: Any = zip(self.layers, kv_caches, self.sliding, strict=True)
        for layer, cache, sliding in layers:
            x, delta = layer.forward_split(
                x, delta, rotation, window_meta if sliding else meta, cache
            )
        return self.norm.add_forward(x, delta)[1]

    def run_stack(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor | None:
        """A decode step's hidden states from the decode stack (models/decode_stack.py), or
        None where the step runs layer by layer."""
        if meta.prefills or meta.decode_rows is None or not self.stack_enabled:
            return None
        if not self._stack_built:
            self._stack, self._stack_built = self.build_stack(), True
        stack = self._stack
        if stack is None or x.dtype != stack.dtype or not stack.takes(x.shape[0], kv_caches):
            return None
        x, delta = stack.run(x, positions, meta, kv_caches)
        return self.norm.add_forward(x, delta)[1]

    def build_stack(self) -> DecodeStack | None:
        """The decode stack of this model on its ops, or None where a part keeps it out."""
        kernel, rotaries = self.ops.stack, self.layer_rotaries()
        if kernel is None or rotaries is None:
            return None
        dtype = self.embed_tokens.weight.dtype
        tables = list(dict.fromkeys(rotaries))  # each table once, in order
        layers = []
        blocks: list[SplitResidualLayer] = list(self.layers)  # type: ignore[arg-type]
        for i, layer in enumerate(blocks):
            spec = layer.stack_layer(kernel, dtype)
            if spec is None:
                return None
            spec.window = self.config.window_of(i) or 0
            spec.rotation = tables.index(rotaries[i])
            layers.append(spec)
        linears = [m for m in self.layers.modules() if isinstance(m, Linear)]
        max_rows = min(m.small_batch for m in linears)
        return DecodeStack(kernel, layers, tuple(tables), dtype, max_rows)

    def layer_rotaries(self) -> tuple[RotaryEmbedding, ...] | None:
        """Each layer's rotary table for the decode stack; None where a token's position is
        not one number (M-RoPE)."""
        return (self.rotary,) * len(self.layers)

    def rotation_at(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The rotary embedding of a step's positions (M-RoPE models take [3, n] positions)."""
        return self.rotary.at(positions, dtype)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """An image's embeddings, one row per placeholder token (models with an encoder)."""
        raise ModelConfigError(f"{self.config.architecture} models take no images")

    def encode_audio(self, features: torch.Tensor, frames: Sequence[int]) -> list[torch.Tensor]:
        """Each clip's embeddings, one row per placeholder token (models with an encoder)."""
        raise ModelConfigError(f"{self.config.architecture} models take no audio")

    def encode_grids(
        self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]
    ) -> list[torch.Tensor]:
        """Each image's or video's embeddings from its patches (Qwen2.5-VL's encoder)."""
        raise ModelConfigError(f"{self.config.architecture} models take no patch grids")

    def encode_patches(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One image's embeddings from its patches and their (x, y) places (Gemma 4's)."""
        raise ModelConfigError(f"{self.config.architecture} models take no placed patches")

    def rope_index(
        self, num_tokens: int, media: Sequence[tuple[int, tuple[int, int, int], float]]
    ) -> torch.Tensor:
        """A prompt's M-RoPE positions [3, num_tokens] (models whose config has
        ``mrope_section``)."""
        raise ModelConfigError(f"{self.config.architecture} models use one position a token")

    def lora_target(self, layer: int, name: str) -> tuple[Linear, int, int]:
        """Where a LoRA target (``q_proj``, ..., ``down_proj``) of a layer lives in the fused
        projections: (the Linear, its first output column, its output width)."""
        cfg = self.config
        block: Any = self.layers[layer]
        attn, mlp = block.self_attn, block.mlp
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        ff = cfg.intermediate_size
        targets = {
            "q_proj": (attn.qkv_proj, 0, q),
            "k_proj": (attn.qkv_proj, q, kv),
            "v_proj": (attn.qkv_proj, q + kv, kv),
            "o_proj": (attn.o_proj, 0, cfg.hidden_size),
        }
        if isinstance(mlp, LlamaMLP):
            targets |= {
                "gate_proj": (mlp.gate_up_proj, 0, ff),
                "up_proj": (mlp.gate_up_proj, ff, ff),
                "down_proj": (mlp.down_proj, 0, cfg.hidden_size),
            }
        elif name in ("gate_proj", "up_proj", "down_proj"):
            raise ModelConfigError(
                f"LoRA target {name!r} of layer {layer}: its MLP is a mixture of experts"
            )
        if name not in targets:
            raise ModelConfigError(f"LoRA target {name!r} is not one of {sorted(targets)}")
        return targets[name]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.forward(hidden).float()
