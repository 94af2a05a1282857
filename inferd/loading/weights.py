"""Build a decoder without memory, then fill it one weight at a time (GGUF or safetensors).

The model is first built on the ``meta`` device; each parameter becomes real only when its
weight arrives, so a load never holds more than the model plus one source tensor. Under ISQ a
projection's dense weight is quantized as soon as it is read and then dropped (or, with weights
from the store, never read at all), so the quantized model is never dense in memory as a whole.

A mixture of experts' source is a stack, one matrix an expert (transformers' fused
``gate_up_proj`` / ``down_proj`` [experts, out, in], named by the ``Experts`` parameter it
fills: ``layers.0.mlp.experts.gate_up_proj``); each matrix fills its expert's projection
(``layers.0.mlp.experts.gate_up_proj.3``) as a projection's own source would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from inferd import kernels
from inferd.config import DEFAULT_MAX_MODEL_LEN
from inferd.host_memory import release_free_heap
from inferd.layers.embedding import Embedding
from inferd.layers.linear import Linear, PackedKind, PackedWeight, packed_on_huge_pages
from inferd.layers.moe import Experts
from inferd.layers.rotary import RopeScaling, RotaryEmbedding, inverse_frequencies
from inferd.loading.quantize import Isq
from inferd.models.config import (
    AUDIO_ARCHITECTURES,
    QWEN_VL_ARCHITECTURES,
    VISION_ARCHITECTURES,
    ModelConfig,
    ModelConfigError,
)
from inferd.models.llama import LlamaForCausalLM


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    if cfg.architecture == "gemma2":
        from inferd.models.gemma import Gemma2ForCausalLM

        return Gemma2ForCausalLM
    if cfg.architecture == "gemma3" and cfg.vision is not None:
        from inferd.models.gemma3_vision import Gemma3VisionForCausalLM

        return Gemma3VisionForCausalLM
    if cfg.architecture == "gemma3":
        from inferd.models.gemma import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    if cfg.architecture == "gemma3n" and (cfg.gemma3n_audio or cfg.gemma3n_vision):
        from inferd.models.gemma3n_multimodal import Gemma3nMultimodalForCausalLM

        return Gemma3nMultimodalForCausalLM
    if cfg.architecture == "gemma3n":
        from inferd.models.gemma3n import Gemma3nForCausalLM

        return Gemma3nForCausalLM
    if cfg.architecture == "gemma4" and (cfg.gemma4_vision or cfg.gemma4_audio):
        from inferd.models.gemma4_multimodal import Gemma4MultimodalForCausalLM

        return Gemma4MultimodalForCausalLM
    if cfg.architecture == "gemma4":
        from inferd.models.gemma4 import Gemma4ForCausalLM

        return Gemma4ForCausalLM
    if cfg.architecture in VISION_ARCHITECTURES or cfg.vision is not None:  # or a --mmproj
        from inferd.models.idefics3 import Idefics3ForCausalLM

        return Idefics3ForCausalLM
    if cfg.architecture == "qwen3_vl":
        from inferd.models.qwen3_vl import Qwen3VLForCausalLM

        return Qwen3VLForCausalLM
    if cfg.architecture in QWEN_VL_ARCHITECTURES:
        from inferd.models.qwen2_5_vl import Qwen2_5_VLForCausalLM

        return Qwen2_5_VLForCausalLM
    if cfg.architecture in AUDIO_ARCHITECTURES:
        from inferd.models.qwen2_audio import Qwen2AudioForCausalLM

        return Qwen2AudioForCausalLM
    return LlamaForCausalLM


def build_empty(cfg: ModelConfig, inv_freq: torch.Tensor, dtype: torch.dtype) -> LlamaForCausalLM:
    """The model with every parameter on ``meta`` (in ``dtype``) and real rotary tables.

    The tables hold the default context's positions, not all the trained ones (Llama 3.1's
    131,072 rows are 128 MiB): serving grows them to its context (``RotaryEmbedding.cover``)."""
    with torch.device("meta"):
        rotary = RotaryEmbedding(cfg.rotary_size, 1, inv_freq.to("meta"))
        model = model_class(cfg)(cfg, rotary).to(dtype)
    rows = min(cfg.max_position, DEFAULT_MAX_MODEL_LEN)
    model.rotary = RotaryEmbedding(cfg.rotary_size, rows, inv_freq)
    if cfg.rope_local_theta is not None:  # Gemma 3's sliding layers: plain RoPE, own base
        local = inverse_frequencies(cfg.rotary_size, cfg.rope_local_theta, RopeScaling())
        model.local_rotary = RotaryEmbedding(cfg.rotary_size, rows, local)
    if cfg.gemma4 is not None:  # Gemma 4 (and 3n): each table as wide as its layers' heads
        from inferd.models.gemma4 import gemma4_rotaries

        model.rotary, model.local_rotary = gemma4_rotaries(cfg, rows)
    return model


@dataclass(frozen=True, slots=True)
class WeightSource:
    """One parameter to fill: how to read it (float32) and, for the small-batch int4/int8
    copy in bf16, which packing keeps it exact; ``read_packed``, where the source is already
    quantized (a GGUF's blocks), builds the VNNI copy without the float32 weight."""

    target: str  # our parameter name
    read: Callable[[], torch.Tensor]
    pack_kind: PackedKind = PackedKind.INT8
    read_packed: Callable[[], PackedWeight] | None = None


def fill(
    model: LlamaForCausalLM,
    sources: Iterable[WeightSource],
    dtype: torch.dtype,
    *,
    total: int,
    packed_kernels: bool = True,
    isq: Isq | None = None,
    progress: bool = True,
) -> None:
    """Fill ``model`` from ``sources``; every parameter must be covered."""
    cfg = model.config
    pack = packed_kernels and kernels.packs_weights(dtype)
    # Quantized weights keep only their VNNI copy (module doc) where those kernels run.
    lean = pack and kernels.int8_dot(dtype)
    bar = tqdm(total=total, desc="load weights", unit="tensor", disable=not progress)
    with torch.no_grad(), bar:
        for src in sources:
            module_name, _, param = src.target.rpartition(".")
            layer = model.get_submodule(module_name)
            experts = expert_projections(model, src.target)
            if experts is not None:
                _fill_experts(experts, src, dtype, pack, isq)
                bar.update(1)
                continue
            tied_head = module_name == "lm_head" and cfg.tie_word_embeddings
            quantized = isq_layer(model, src.target, isq) if isq is not None else None
            if quantized is not None and isq is not None and module_name in isq.stored:
                isq.apply(module_name, quantized, None)  # the store has it: skip the source
                bar.update(1)
                continue
            if tied_head and model.embed_tokens.packed is not None:
                model.lm_head = model.embed_tokens.packed  # one packed table for both
                bar.update(1)
                continue
            lean_source = lean and quantized is None and param == "weight"
            if lean_source and src.read_packed and _fill_packed(model, layer, src.read_packed):
                # The pieces' temporaries go back to the OS now: glibc would keep them, and
                # the next weight's would land elsewhere (1B: 0.8 GiB more at the end).
                release_free_heap()
                bar.update(1)
                continue
            if tied_head:  # the embedding, already loaded; maybe a packed copy for decode
                model.lm_head.weight = model.embed_tokens.weight
                if pack:
                    model.lm_head.pack(src.pack_kind, source=src.read())
                bar.update(1)
                continue
            weight = src.read()
            _set(layer, param, weight, dtype)
            if quantized is not None and isq is not None:
                isq.apply(module_name, quantized, weight)
            elif pack and param == "weight" and isinstance(layer, Linear):
                layer.pack(src.pack_kind, source=weight)
            bar.update(1)
    if cfg.tie_word_embeddings and model.embed_tokens.packed is None:
        model.lm_head.weight = model.embed_tokens.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelConfigError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
    model.eval().requires_grad_(False)
    packed_on_huge_pages(model)


def isq_layer(model: LlamaForCausalLM, target: str, isq: Isq) -> Linear | None:
    """The projection whose weight ``target`` names, when ``isq`` quantizes it; else None."""
    module_name, _, param = target.rpartition(".")
    layer = model.get_submodule(module_name)
    tied_head = module_name == "lm_head" and model.config.tie_word_embeddings
    if param != "weight" or not isinstance(layer, Linear):
        return None
    return layer if isq.applies(module_name, layer, tied_head) else None


@dataclass(frozen=True, slots=True)
class Projection:
    """A projection a source fills: its module name, and which matrix of the source it takes
    (``expert``: the source is an expert stack; None: the source is its weight)."""

    name: str
    layer: Linear
    expert: int | None = None

    def weight(self, source: torch.Tensor) -> torch.Tensor:
        return source if self.expert is None else source[self.expert]


def expert_projections(model: nn.Module, target: str) -> list[Projection] | None:
    """Each expert's projection an expert stack's source fills (``target`` names an
    ``Experts`` stack: ``gate_up_proj`` or ``down_proj``), in the stack's order; None for any
    other target."""
    module_name, _, param = target.rpartition(".")
    experts = model.get_submodule(module_name)
    if not isinstance(experts, Experts):
        return None
    stack = getattr(experts, param)
    return [Projection(f"{target}.{e}", layer, e) for e, layer in enumerate(stack)]


def isq_projections(model: LlamaForCausalLM, target: str, isq: Isq) -> list[Projection]:
    """The projections a source of ``target`` fills that ``isq`` quantizes: an expert stack's
    (every expert's, as ``fill`` quantizes them), the one projection it names, or none."""
    experts = expert_projections(model, target)
    if experts is not None:
        return experts
    layer = isq_layer(model, target, isq)
    return [] if layer is None else [Projection(target.rpartition(".")[0], layer)]


def _fill_experts(
    experts: list[Projection], src: WeightSource, dtype: torch.dtype, pack: bool, isq: Isq | None
) -> None:
    """Each expert's projection from its matrix of the stack ``src`` reads, as a projection's
    own source fills it: quantized by ``isq`` (not read at all when the store has them all),
    else dense with its packed copy."""
    if isq is not None and all(p.name in isq.stored for p in experts):
        for p in experts:
            isq.apply(p.name, p.layer, None)
        return
    stack = src.read()
    if stack.dim() != 3 or stack.shape[0] != len(experts):
        raise ModelConfigError(
            f"{src.target} has shape {tuple(stack.shape)}, expected {len(experts)} experts' "
            "matrices"
        )
    for p in experts:
        weight = p.weight(stack)
        _set(p.layer, "weight", weight, dtype)
        if isq is not None:
            isq.apply(p.name, p.layer, weight)
        elif pack:
            p.layer.pack(src.pack_kind, source=weight)


def _fill_packed(
    model: LlamaForCausalLM, layer: nn.Module, read: Callable[[], PackedWeight]
) -> bool:
    """Give a projection or the embedding its packed copy alone (no dense weight); False for
    another kind of module."""
    if isinstance(layer, Linear):
        layer.use_packed_only(*read())
        return True
    if isinstance(layer, Embedding) and layer is model.embed_tokens:
        with torch.device("meta"):  # no [vocab, hidden] float32 weight made and dropped
            table = Linear(layer.embedding_dim, layer.num_embeddings)
        table.weight = nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)
        table.use_packed_only(*read())
        layer.use_packed(table)
        return True
    return False


def _set(module: nn.Module, name: str, value: torch.Tensor, dtype: torch.dtype) -> None:
    current = getattr(module, name)
    if tuple(current.shape) != tuple(value.shape):
        raise ModelConfigError(
            f"weight {name} of {type(module).__name__} has shape {tuple(value.shape)}, "
            f"expected {tuple(current.shape)}"
        )
    setattr(module, name, nn.Parameter(value.to(dtype), requires_grad=False))
