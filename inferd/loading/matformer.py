"""MatFormer slices of a Gemma 3n checkpoint (``--matformer-config FILE --matformer-slice NAME``).

Gemma 3n is trained as nested models: a smaller one is the larger one with each layer's MLP cut
to its first units and some layers dropped. Google publishes the slices as a CSV
(``MatFormer-config.csv``), one row a slice::

    name,# Layers,# Effective Params (B),MMLU PT accuracy,FFN Hidden Dims,Layers Skipped
    Config for official E2B Model,30,1.91,50.90%,"[2_048 * 4, ...]","[20, 21, 22, 23, 24]"

``FFN Hidden Dims`` lists the MLP width of each layer kept (numbers, ``2_048`` spelled with
underscores, or ``a * b`` products); ``Layers Skipped`` (empty: none) the checkpoint layers
dropped. ``slice_text_config`` turns the checkpoint's text config into the sliced model's, as
Gemma 3n's own slicing recipe does: the per-layer lists keep the layers kept, the K/V-sharing
count loses the skipped layers that shared, and the layers whose keys and values the sharing
layers read may not be skipped. The loader then reads each kept layer's weights, cut
(loading/hf_layout.py ``gemma3n_plan``).
"""

from __future__ import annotations

import csv
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from inferd.models.config import ModelConfig, ModelConfigError, config_from_hf, gemma3n_text_config

COLUMNS = ("name", "FFN Hidden Dims", "Layers Skipped")
_TERM = re.compile(r"^\d[\d_]*$")


@dataclass(frozen=True, slots=True)
class MatformerSlice:
    name: str
    ffn_dims: tuple[int, ...]  # the MLP width of each layer kept
    skipped: tuple[int, ...]  # checkpoint layers dropped


def _number(text: str, where: str) -> int:
    """``2_048 * 4``, ``8192`` or ``2_048``: a product of integers."""
    value = 1
    for term in text.split("*"):
        term = term.strip()
        if not _TERM.match(term):
            raise ModelConfigError(f"{where}: {text.strip()!r} is not a number")
        value *= int(term.replace("_", ""))
    return value


def _numbers(text: str, where: str) -> tuple[int, ...]:
    text = text.strip()
    if not text:
        return ()
    if not (text.startswith("[") and text.endswith("]")):
        raise ModelConfigError(f"{where}: expected a [..] list, got {text!r}")
    inner = text[1:-1].strip()
    return tuple(_number(t, where) for t in inner.split(",")) if inner else ()


def read_matformer_slices(path: str | Path) -> dict[str, MatformerSlice]:
    """Every slice of a MatFormer config CSV, by name."""
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
            header = rows[0].keys() if rows else ()
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ModelConfigError(f"--matformer-config {path}: cannot read it ({exc})") from None
    missing = [c for c in COLUMNS if c not in header]
    if not rows or missing:
        raise ModelConfigError(
            f"--matformer-config {path}: not a MatFormer config CSV (needs the columns "
            f"{', '.join(COLUMNS)}; {'lacks ' + ', '.join(missing) if missing else 'no rows'})"
        )
    slices: dict[str, MatformerSlice] = {}
    for line, row in enumerate(rows, start=2):
        name = (row["name"] or "").strip()
        where = f"--matformer-config {path} line {line}"
        dims = _numbers(row["FFN Hidden Dims"] or "", where)
        if not name or not dims:
            raise ModelConfigError(f"{where}: a slice needs a name and FFN Hidden Dims")
        slices[name] = MatformerSlice(name, dims, _numbers(row["Layers Skipped"] or "", where))
    return slices


def matformer_slice(path: str | Path, name: str) -> MatformerSlice:
    slices = read_matformer_slices(path)
    if name not in slices:
        raise ModelConfigError(
            f"--matformer-slice {name!r} is not in {path} (its slices: "
            f"{', '.join(repr(n) for n in slices)})"
        )
    return slices[name]


def slice_text_config(
    text: dict[str, Any], cut: MatformerSlice
) -> tuple[dict[str, Any], tuple[int, ...]]:
    """The sliced model's text config and the checkpoint layer of each of its layers, from a
    Gemma 3n text config with its per-layer lists written out (``gemma3n_text_config``)."""
    layers = int(text["num_hidden_layers"])
    types: list[str] = list(text["layer_types"])
    widths: list[int] = [int(w) for w in text["intermediate_size"]]
    skipped = set(cut.skipped)
    where = f"MatFormer slice {cut.name!r}"
    outside = sorted(i for i in skipped if not 0 <= i < layers)
    if outside:
        raise ModelConfigError(f"{where} skips layers {outside}; the model has {layers}")
    kept = tuple(i for i in range(layers) if i not in skipped)
    if len(cut.ffn_dims) != len(kept):
        raise ModelConfigError(
            f"{where} gives {len(cut.ffn_dims)} FFN widths for the {len(kept)} layers it keeps"
        )
    wider = [(i, w, widths[i]) for i, w in zip(kept, cut.ffn_dims, strict=True) if w > widths[i]]
    if wider:
        layer, want, have = wider[0]
        raise ModelConfigError(
            f"{where}: layer {layer}'s MLP is {have} wide; a slice cannot widen it to {want}"
        )
    shared = int(text.get("num_kv_shared_layers") or 0)
    first_shared = layers - shared
    if shared:  # the last layer of each kind before the sharing ones holds their K/V
        sources = {
            max((i for i in range(first_shared) if types[i] == t), default=-1) for t in types
        }
        reserved = sorted(skipped & sources)
        if reserved:
            raise ModelConfigError(
                f"{where} skips layers {reserved}, whose keys and values later layers share"
            )
    sliced = dict(text)
    sliced["num_hidden_layers"] = len(kept)
    sliced["layer_types"] = [types[i] for i in kept]
    sliced["intermediate_size"] = list(cut.ffn_dims)
    sliced["activation_sparsity_pattern"] = [text["activation_sparsity_pattern"][i] for i in kept]
    sliced["num_kv_shared_layers"] = shared - sum(1 for i in skipped if i >= first_shared)
    return sliced, kept


def sliced_model_config(
    hf: Mapping[str, Any], cut: MatformerSlice, *, has_lm_head: bool
) -> ModelConfig:
    """Our config of the slice ``cut`` of a Gemma 3n ``config.json``: the sliced model's, its
    layers reading the checkpoint's layers kept."""
    model_type = hf.get("model_type")
    if model_type not in ("gemma3n", "gemma3n_text"):
        raise ModelConfigError(
            f"MatFormer slices (--matformer-slice) apply to Gemma 3n checkpoints, not "
            f"model_type {model_type!r}"
        )
    text = gemma3n_text_config(hf)
    sliced, kept = slice_text_config(text, cut)
    whole = {**hf, "text_config": sliced} if model_type == "gemma3n" else sliced
    cfg = config_from_hf(whole, has_lm_head=has_lm_head)
    assert cfg.gemma3n is not None
    own = replace(cfg.gemma3n, source_layers=kept, source_num_layers=int(text["num_hidden_layers"]))
    return replace(cfg, gemma3n=own)
