"""What a served model is made of, one digest per part: weights, tokenizer, chat template,
processor configuration and quantization recipe.

A bundle's digest says only that *something* changed; the release gate (``gate.py``) needs to
say *what*: a new chat template, a retrained tokenizer, another quantization of the same
weights. Each part is digested on its own, from the files the server reads:

- a GGUF file: the weights are its tensors' bytes, in order; the tokenizer is every
  ``tokenizer.*`` key but the template; the template is ``tokenizer.chat_template``; the
  quantization recipe is ``general.file_type`` and each tensor's type; the processor is a
  ``--mmproj`` file beside it, when the plan names one (else none);
- a Hugging Face directory: the weights are its ``*.safetensors`` files; the tokenizer is
  ``tokenizer.json`` and ``tokenizer_config.json`` without its template; the template is
  ``chat_template.jinja`` or the config's ``chat_template``; the processor is its
  ``*processor_config.json`` files; the quantization recipe is ``config.json``'s
  ``quantization_config`` (none: the checkpoint's own dtype).

A part the model does not have is ``None``. A plan of a config bundle (``inferd serve
--config``) is digested through the model its route names (``served_model_path``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from inferd.contract.canonical import digest_of
from inferd.contract.plan import LaunchPlan, ModelFormat

PARTS = ("weights", "tokenizer", "chat_template", "processor", "quantization")
_CHUNK = 1 << 22


def model_identity(path: Path) -> dict[str, str | None]:
    """The digest of each of ``path``'s parts (``PARTS``), a GGUF file or a model directory."""
    return _directory_identity(path) if path.is_dir() else _gguf_identity(path)


def served_model_path(plan: LaunchPlan) -> Path:
    """The file or directory of the model ``plan`` talks to: its GGUF entry, or in a config
    bundle the ``model_id`` of the entry whose alias (or label) is the plan's route, read
    relative to the bundle, where the server runs. ValueError when the config names no such
    model inside the bundle."""
    entry = Path(plan.model.entry_path)
    if plan.model.format is not ModelFormat.CONFIG:
        return entry
    config = json.loads(entry.read_text(encoding="utf-8"))
    for label, spec in config.items():
        if plan.model_route not in (label, spec.get("alias")):
            continue
        sources = [v for v in spec.values() if isinstance(v, dict) and "model_id" in v]
        if len(sources) == 1:
            path = (entry.parent / str(sources[0]["model_id"])).resolve()
            if path.is_relative_to(entry.parent.resolve()) and path.exists():
                return path
    raise ValueError(f"{entry.name} names no model {plan.model_route!r} inside its bundle")


def changed_parts(old: dict[str, str | None], new: dict[str, str | None]) -> list[str]:
    return [part for part in PARTS if old.get(part) != new.get(part)]


def _gguf_identity(path: Path) -> dict[str, str | None]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    values = {name: _field_value(field) for name, field in reader.fields.items()}
    template = values.get("tokenizer.chat_template")
    tokenizer = {
        k: v
        for k, v in values.items()
        if k.startswith("tokenizer.") and k != "tokenizer.chat_template"
    }
    weights = hashlib.sha256()
    for tensor in reader.tensors:
        weights.update(tensor.name.encode() + b"\0")
        weights.update(tensor.data.tobytes())
    recipe = {
        "file_type": values.get("general.file_type"),
        "tensors": [[t.name, t.tensor_type.name] for t in reader.tensors],
    }
    return {
        "weights": weights.hexdigest(),
        "tokenizer": digest_of(tokenizer) if tokenizer else None,
        "chat_template": _text_digest(template) if isinstance(template, str) else None,
        "processor": None,
        "quantization": digest_of(recipe),
    }


def _field_value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, float) and value != value:  # NaN has no canonical JSON
        return "nan"
    return value


def _directory_identity(path: Path) -> dict[str, str | None]:
    config = _json(path / "tokenizer_config.json")
    template = config.pop("chat_template", None) if config is not None else None
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    tokenizer_json = path / "tokenizer.json"
    tokenizer = {
        "tokenizer.json": _file_digest(tokenizer_json) if tokenizer_json.is_file() else None,
        "tokenizer_config": config,
    }
    processors = sorted(path.glob("*processor_config.json"))
    model_config = _json(path / "config.json") or {}
    return {
        "weights": _files_digest(sorted(path.glob("*.safetensors"))),
        "tokenizer": digest_of(tokenizer) if any(tokenizer.values()) else None,
        "chat_template": None if template is None else _text_digest(json.dumps(template)),
        "processor": _files_digest(processors) if processors else None,
        "quantization": digest_of(model_config.get("quantization_config") or "none"),
    }


def _json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else None


def _text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files_digest(paths: list[Path]) -> str | None:
    if not paths:
        return None
    return digest_of({p.name: _file_digest(p) for p in paths})
