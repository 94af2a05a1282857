"""Load a sentence-embedding model directory: a BERT encoder from its transformers-layout
checkpoint (``embeddings.*``, ``encoder.layer.N.*``, optionally under a ``bert.`` prefix)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from inferd.loading.safetensors import SafetensorsCheckpoint
from inferd.models.bert import BertConfig, BertModel


def is_embedding_directory(path: Path) -> bool:
    """Whether ``path`` looks like a sentence-embedding model directory we can load."""
    cfg = path / "config.json"
    if not path.is_dir() or not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text())
    except ValueError:
        return False
    archs = data.get("architectures") or []
    return data.get("model_type") == "bert" or "BertModel" in archs


def load_bert(directory: Path, dtype: torch.dtype = torch.float32) -> BertModel:
    """A BertModel with the weights of ``directory`` (config.json + safetensors)."""
    cfg = BertConfig.from_file(directory / "config.json")
    ckpt = SafetensorsCheckpoint(directory)
    prefix = "bert." if any(n.startswith("bert.embeddings.") for n in ckpt) else ""
    with torch.device("meta"):
        model = BertModel(cfg)
    state = {name: _read(ckpt, prefix + src, model, name) for name, src in _weight_names(cfg)}
    for i in range(cfg.num_layers):
        for kind in ("weight", "bias"):
            state[f"layers.{i}.qkv.{kind}"] = _fused_qkv(ckpt, prefix, i, model, kind)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return model.eval()


def _weight_names(cfg: BertConfig) -> list[tuple[str, str]]:
    """(our parameter, checkpoint tensor) pairs, q/k/v aside (they are fused)."""
    pairs = [
        ("embeddings.word.weight", "embeddings.word_embeddings.weight"),
        ("embeddings.position.weight", "embeddings.position_embeddings.weight"),
        ("embeddings.token_type.weight", "embeddings.token_type_embeddings.weight"),
        ("embeddings.norm.weight", "embeddings.LayerNorm.weight"),
        ("embeddings.norm.bias", "embeddings.LayerNorm.bias"),
    ]
    ours_theirs = (
        ("attn_out", "attention.output.dense"),
        ("attn_norm", "attention.output.LayerNorm"),
        ("ffn_in", "intermediate.dense"),
        ("ffn_out", "output.dense"),
        ("ffn_norm", "output.LayerNorm"),
    )
    for i in range(cfg.num_layers):
        for ours, theirs in ours_theirs:
            for p in ("weight", "bias"):
                pairs.append((f"layers.{i}.{ours}.{p}", f"encoder.layer.{i}.{theirs}.{p}"))
    return pairs


def _read(ckpt: SafetensorsCheckpoint, src: str, model: BertModel, name: str) -> torch.Tensor:
    if src not in ckpt:
        raise ValueError(f"{ckpt.path}: the checkpoint lacks {src!r}")
    tensor = ckpt.load_tensor(src)
    want = tuple(model.get_parameter(name).shape)
    if tuple(tensor.shape) != want:
        raise ValueError(f"{src}: shape {tuple(tensor.shape)} does not match the config's {want}")
    return tensor


def _fused_qkv(
    ckpt: SafetensorsCheckpoint, prefix: str, layer: int, model: BertModel, kind: str
) -> torch.Tensor:
    parts = []
    for which in ("query", "key", "value"):
        src = f"{prefix}encoder.layer.{layer}.attention.self.{which}.{kind}"
        if src not in ckpt:
            raise ValueError(f"{ckpt.path}: the checkpoint lacks {src!r}")
        parts.append(ckpt.load_tensor(src))
    fused = torch.cat(parts, dim=0)
    want = tuple(model.get_parameter(f"layers.{layer}.qkv.{kind}").shape)
    if tuple(fused.shape) != want:
        raise ValueError(f"layer {layer} q/k/v {kind}: shape {tuple(fused.shape)}, expected {want}")
    return fused
