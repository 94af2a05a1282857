"""Gemma 3n's decoder (models/gemma3n.py) from a GGUF in llama.cpp's layout
(convert_hf_to_gguf.py's ``Gemma3NModel``): its config from the ``gemma3n.*`` keys and the
tensors, and where each of our parameters lives.

Gemma 3n's layers are Gemma 4's parts (loading/gguf_gemma4.py reads their tensors: norms that
scale by ``w``, no ``1 + w`` shift, K/V-sharing layers read for their queries alone, the
per-layer embeddings) around AltUp and Laurel. What the converter writes, and how it is read
back:

- every layer's MLP width as the ``feed_forward_length`` array; the sparse layers' gate cut-off
  as ``activation_sparsity_scale``, the normal quantile of the target sparsity (``-inf`` for a
  dense layer), turned back into the sparsity, whose quantile in float32 is that very number;
- AltUp's three projections of the embeddings in and out as one stacked tensor each
  (``altup_proj``, ``altup_unembd_proj``), taken apart again; its per-layer router, norms and
  coefficients and Laurel's branch one to one. The file does not say ``altup_correct_scale``:
  llama.cpp always scales the corrected stream (as every released Gemma 3n does);
- the per-layer embedding table padded with zero rows up to the text vocabulary (the converter
  fills the media tokens' ids so); those rows are dropped again, so that ids past the table read
  its row 0, as transformers' model does;
- no media tables: a ConditionalGeneration checkpoint's ``embed_vision``/``embed_audio`` go to
  its projector, which this converter cannot write for Gemma 3n, so the file is a text model.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from inferd.loading.gguf import GGUFFile, Transform
from inferd.loading.gguf_gemma4 import gemma4_weight_plan
from inferd.models.config import (
    Gemma3nLayers,
    ModelConfig,
    ModelConfigError,
    gemma3n_decoder_config,
    gguf_key,
)

ARCH = "gemma3n"
PER_LAYER_TABLE = "per_layer_token_embd.weight"
_STACKS = {
    "altup_projections": "altup_proj.weight",
    "altup_unembed_projections": "altup_unembd_proj.weight",
}
# Rows read at a time while looking for the converter's zero padding at the table's end.
_TAIL_ROWS = 256


def gemma3n_config(gguf: GGUFFile) -> ModelConfig:
    """The decoder's config; ModelConfigError for what the file lacks or inferd cannot run."""
    meta = gguf.metadata
    shapes = {i.name: i.shape for i in gguf.tensor_infos()}

    key = functools.partial(gguf_key, meta, ARCH)

    layers = int(key("block_count"))
    pattern = _per_layer(key("attention.sliding_window_pattern"), layers, "sliding_window_pattern")
    widths = _per_layer(key("feed_forward_length"), layers, "feed_forward_length")
    kv_heads = set(_per_layer(key("attention.head_count_kv"), layers, "head_count_kv"))
    if len(kv_heads) != 1:
        raise ModelConfigError(f"gemma3n layers with different K/V head counts: {kv_heads}")
    scales = _per_layer(key("activation_sparsity_scale"), layers, "activation_sparsity_scale")
    stack = shapes.get(_STACKS["altup_projections"])
    inputs = int(key("altup.num_inputs"))
    if stack is None or stack[0] != inputs - 1:
        raise ModelConfigError(f"gemma3n needs {inputs - 1} stacked altup_proj matrices")
    own = Gemma3nLayers(
        altup_inputs=inputs,
        altup_active=int(key("altup.active_idx")),
        altup_correct_scale=True,
        laurel_rank=shapes["blk.0.laurel_l.weight"][0],
        intermediate_sizes=tuple(int(w) for w in widths),
        sparsity=tuple(_sparsity(float(s)) for s in scales),
        source_layers=tuple(range(layers)),
        source_num_layers=layers,
    )
    softcap = meta.get(f"{ARCH}.final_logit_softcapping")
    return gemma3n_decoder_config(
        vocab_size=shapes["token_embd.weight"][0],
        hidden_size=int(key("embedding_length")),
        num_heads=int(key("attention.head_count")),
        num_kv_heads=int(kv_heads.pop()),
        head_dim=int(key("attention.key_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base")),
        rope_local_theta=float(key("rope.freq_base_swa")),
        max_position=int(key("context_length")),
        tie_word_embeddings="output.weight" not in shapes,
        sliding_window=int(key("attention.sliding_window")),
        sliding_layers=tuple(i for i, s in enumerate(pattern) if s),
        final_softcap=None if softcap is None else float(softcap),
        kv_shared_layers=int(meta.get(f"{ARCH}.attention.shared_kv_layers") or 0),
        per_layer_size=int(key("embedding_length_per_layer_input")),
        per_layer_vocab=_per_layer_vocab(gguf),
        layers=own,
    )


def _per_layer(value: Any, layers: int, name: str) -> list[Any]:
    """A key llama.cpp writes once, or once per layer where layers differ."""
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers:
        raise ModelConfigError(f"{ARCH}.{name} has {len(values)} entries for {layers} layers")
    return values


def _sparsity(scale: float) -> float:
    """The target sparsity whose normal quantile the converter wrote (``-inf``: a dense layer);
    its float32 quantile, as models/gemma3n.py computes it, is ``scale`` again."""
    return 0.5 * math.erfc(-scale / math.sqrt(2))


def _per_layer_vocab(gguf: GGUFFile) -> int:
    """The per-layer table's rows less the converter's zero padding at its end (the media ids
    it adds up to the text vocabulary; no trained row is all zeros)."""
    info = next((i for i in gguf.tensor_infos() if i.name == PER_LAYER_TABLE), None)
    if info is None:
        raise ModelConfigError(f"gemma3n GGUF lacks {PER_LAYER_TABLE}")
    end = info.shape[0]
    while end > 0:
        start = max(0, end - _TAIL_ROWS)
        nonzero = gguf.load_rows(PER_LAYER_TABLE, start, end).abs().amax(dim=1).nonzero()
        if len(nonzero):
            return start + int(nonzero[-1]) + 1
        end = start
    raise ModelConfigError(f"gemma3n {PER_LAYER_TABLE} is all zeros")


def gemma3n_weight_plan(cfg: ModelConfig) -> tuple[dict[str, list[str]], dict[str, Transform]]:
    """Our parameters from llama.cpp's tensors (Gemma 4's parts as ``gemma4_weight_plan`` reads
    them, less its per-layer output scalar, which Gemma 3n has not), and the few that are not
    stored as transformers holds them: how to undo the converter's change."""
    g, shared = cfg.gemma3n, cfg.gemma4
    assert g is not None and shared is not None
    plan = {k: v for k, v in gemma4_weight_plan(cfg).items() if not k.endswith(".layer_scalar")}
    own = {
        "altup.correct_output_scale": "altup_correct_scale.weight",
        "altup.correction_coefs.weight": "altup_correct_coef.weight",
        "altup.prediction_coefs.weight": "altup_predict_coef.weight",
        "altup.modality_router.weight": "altup_router.weight",
        "altup.router_norm.weight": "altup_router_norm.weight",
        "laurel.linear_left.weight": "laurel_l.weight",
        "laurel.linear_right.weight": "laurel_r.weight",
        "laurel.post_laurel_norm.weight": "laurel_post_norm.weight",
    }
    for i in range(cfg.num_layers):
        plan |= {f"layers.{i}.{ours}": [f"blk.{i}.{theirs}"] for ours, theirs in own.items()}
    transforms: dict[str, Transform] = {}
    for ours, stacked in _STACKS.items():
        for j in range(g.altup_inputs - 1):
            plan[f"{ours}.{j}.weight"] = [stacked]
            transforms[f"{ours}.{j}.weight"] = _matrix(j)
    vocab = shared.per_layer_vocab
    transforms["embed_tokens_per_layer.weight"] = lambda t, _: t[:vocab]
    return plan, transforms


def _matrix(j: int) -> Transform:
    return lambda t, _: t[j]
