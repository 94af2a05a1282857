"""A TokenizerBundle from a Hugging Face model directory (``tokenizer.json`` and friends).

``tokenizer.json`` is the fast tokenizer itself; what the engine needs around it comes from
``tokenizer_config.json`` (BOS/EOS tokens, whether to add BOS) and from the vocabulary: the raw
bytes of every token, for incremental detokenization. Those are read off the spelling:

* byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): each character of a token stands for one byte
  through GPT-2's printable alphabet;
* SentencePiece-style BPE with byte fallback (Llama 2, Mistral, Gemma): ``<0xAB>`` tokens are
  single bytes and ``▁`` is a space; other pieces are UTF-8 text.

Added tokens (``<|im_start|>``, ``<think>``) are their own text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from inferd.loading.tokenizer import (
    _BYTE_TOKEN,
    _SPM_SPACE,
    TokenizerBundle,
    TokenizerError,
    _byte_level_token_bytes,
)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _components(node: Any, kind: str) -> list[dict[str, Any]]:
    """Every component of ``kind`` in a tokenizer.json pipeline stage (Sequences flattened)."""
    if not isinstance(node, Mapping):
        return []
    if node.get("type") == "Sequence":
        key = next((k for k in ("decoders", "pretokenizers", "normalizers") if k in node), "")
        return [c for child in node.get(key, []) for c in _components(child, kind)]
    return [dict(node)] if node.get("type") == kind else []


def tokenizer_from_hf(
    directory: Path,
    *,
    vocab_size: int | None = None,
    eos_token_id: int | None = None,
) -> TokenizerBundle:
    """Read ``directory``'s tokenizer. ``vocab_size``: the model's embedding rows (the byte
    table covers them all; ids past the tokenizer's vocabulary decode to nothing).
    ``eos_token_id``: from config.json / generation_config.json when tokenizer_config.json
    names no EOS token."""
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        raise TokenizerError(f"{directory}: no {TOKENIZER_FILE} (only fast tokenizers are read)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers package raises its own exception type
        raise TokenizerError(f"{path}: not a tokenizer.json ({exc})") from None
    spec = read_json(path)
    config = read_json(directory / TOKENIZER_CONFIG)
    special_map = read_json(directory / "special_tokens_map.json")

    added = tok.get_added_tokens_decoder()
    n = max(tok.get_vocab_size(with_added_tokens=True), vocab_size or 0, *(i + 1 for i in added))
    model = spec.get("model") or {}
    byte_level = bool(
        _components(spec.get("decoder"), "ByteLevel")
        or _components(spec.get("pre_tokenizer"), "ByteLevel")
    )
    spm = not byte_level and bool(
        model.get("byte_fallback")
        or _components(spec.get("decoder"), "ByteFallback")
        or _components(spec.get("decoder"), "Metaspace")
        or _components(spec.get("pre_tokenizer"), "Metaspace")
    )
    table: list[bytes] = []
    for i in range(n):
        piece = tok.id_to_token(i)
        if i in added:
            table.append(added[i].content.encode("utf-8"))
        elif piece is None:
            table.append(b"")
        elif byte_level:
            table.append(_byte_level_token_bytes(piece))
        elif spm and (m := _BYTE_TOKEN.match(piece)):
            table.append(bytes([int(m.group(1), 16)]))
        else:
            table.append(piece.replace(_SPM_SPACE, " ").encode("utf-8"))

    def special(name: str) -> tuple[str | None, int | None]:
        text = _token_text(config.get(name)) or _token_text(special_map.get(name))
        return text, (tok.token_to_id(text) if text is not None else None)

    bos, bos_id = special("bos_token")
    eos, eos_id = special("eos_token")
    if eos_id is None and eos_token_id is not None and 0 <= eos_token_id < n:
        eos_id, eos = eos_token_id, tok.id_to_token(eos_token_id)
    if "add_bos_token" in config:
        add_bos = bool(config["add_bos_token"])
    else:  # what the tokenizer's own post-processor does
        ids = tok.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and ids[:1] == [bos_id]
    special_ids = {i for i, t in added.items() if t.special}
    special_ids.update(i for i in (bos_id, eos_id) if i is not None)
    prepend = [
        c
        for c in _components(spec.get("pre_tokenizer"), "Metaspace")
        if c.get("prepend_scheme", "always") != "never" and c.get("add_prefix_space", True)
    ] + _components(spec.get("normalizer"), "Prepend")
    return TokenizerBundle(
        tokenizer=tok,
        bos_token=bos,
        eos_token=eos,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        add_bos=add_bos,
        special_ids=frozenset(special_ids),
        token_bytes=tuple(table),
        model_type="gpt2" if byte_level else "llama" if spm else str(model.get("type", "")),
        add_space_prefix=spm and bool(prepend),
    )


def chat_template_source(directory: Path) -> str | None:
    """The chat template: ``chat_template.jinja`` (transformers v5), else tokenizer_config.json's
    ``chat_template`` (a string, or a list of named templates: the ``default`` one)."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    value = read_json(directory / TOKENIZER_CONFIG).get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        value = named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) and value.strip() else None
