"""ModelSpec: what to load and how, from `-m`, a Python caller or a models file (JSON or TOML).

A models file maps labels (for people; never an API id) to one entry each::

    {
      "chat": {"GGUF": {"model_id": "smollm2"}, "max_seqs": 8},
      "embed": {"Embedding": {"model_id": "minilm"}, "alias": "text-embedding"}
    }

Each entry names exactly one kind (``GGUF``, ``Plain`` or ``Embedding``) whose object holds the
source: ``model_id`` is a store name, a file or a directory; GGUF also takes
``quantized_model_id`` + ``quantized_filename`` (a file inside a directory or store entry).
The optional settings (``alias``, ``chat_template``, ``jinja_explicit``, ``tool_call_parser``,
``dtype``, ``in_situ_quant``, ``max_seq_len``, ``max_seqs``, ``kv_cache_dtype`` (as
`--kv-cache-dtype`; ``inferd tune --emit-config`` writes it), ``lora``, and for GGUF ``mmproj``:
a llama.cpp multimodal projector file) may sit beside the kind or inside it.

``lora`` serves PEFT adapters on that model, each as its own model (`--lora` for `-m`): an
object mapping each adapter's API id to its directory (TOML: a ``[label.lora]`` table), or an
array of ``"NAME=PATH"`` strings as `--lora` takes them::

    {"chat": {"GGUF": {"model_id": "smollm2"}, "lora": {"pirate": "adapters/pirate"}}}

The API id is the alias, else derived from the source: a store name as is, a file's stem, a
directory's name. Every mistake is reported with its key path and what was expected, all at
once, before any model loads.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.config import DTYPES, KV_CACHE_DTYPES
from inferd.store import CATALOG
from inferd.structured.tool_syntax import PARSERS

# VisionPlain: a Plain directory whose model reads media (mistral.rs's name), checked on load
KINDS = ("GGUF", "Plain", "VisionPlain", "Embedding")
_SOURCE_FIELDS = ("model_id", "quantized_model_id", "quantized_filename", "tok_model_id")
_SETTINGS = (
    "alias",
    "chat_template",
    "jinja_explicit",
    "tool_call_parser",
    "dtype",
    "in_situ_quant",
    "max_seq_len",
    "max_seqs",
    "kv_cache_dtype",
    "mmproj",
    "lora",
    "hf_config_overrides",
    "matformer_config_path",
    "matformer_slice_name",
    "imatrix",
    "prefix_cache_n",
    "max_decode_steps_before_prefill",
    "no_kv_cache",
)
_GENERATIVE_ONLY = (
    "chat_template",
    "jinja_explicit",
    "tool_call_parser",
    "in_situ_quant",
    "kv_cache_dtype",
    "lora",
    "hf_config_overrides",
    "matformer_config_path",
    "matformer_slice_name",
    "imatrix",
    "prefix_cache_n",
    "max_decode_steps_before_prefill",
    "no_kv_cache",
)
# in-situ quantization names (ours, and the closest of mistral.rs's) -> our method
ISQ_NAMES = {
    **dict.fromkeys(("Q8", "Q8_0", "Q8_1", "Q8K"), "q8"),
    **dict.fromkeys(("Q4", "Q4_0", "Q4_1", "Q4K"), "q4"),
}


class SpecError(ValueError):
    """A models file (or spec) that is wrong; one line per problem, each with its key path."""

    def __init__(self, problems: list[str], origin: str = "") -> None:
        self.problems = problems
        head = f"{origin}: " if origin else ""
        if len(problems) == 1:
            super().__init__(head + problems[0])
        else:
            super().__init__(
                f"{head}{len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems)
            )


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model to serve. ``kind`` "auto" (from `-m`) is decided by what the source is."""

    model_id: str
    kind: str = "auto"  # auto | GGUF | Plain | VisionPlain | Embedding
    filename: str | None = None  # a GGUF file inside model_id (quantized_filename)
    label: str | None = None
    alias: str | None = None
    chat_template: str | None = None  # Jinja source (files already read)
    dtype: str | None = None  # None: the server's --dtype
    in_situ_quant: str | None = None  # q8 | q4
    max_seq_len: int | None = None
    max_seqs: int | None = None
    kv_cache_dtype: str | None = None  # None: the server's --kv-cache-dtype
    tool_call_parser: str | None = None  # None: the syntax the chat template shows
    mmproj: str | None = None  # a llama.cpp multimodal projector file (GGUF models)
    lora: tuple[tuple[str, str], ...] = ()  # (API id, directory) of each PEFT adapter on it
    # A JSON object merged into a Hugging Face directory's config.json (--hf-config-overrides);
    # kept as text so the spec stays hashable.
    hf_config_overrides: str | None = None
    # A Gemma 3n MatFormer slice: the slice table (CSV) and the row to serve, both or neither.
    matformer_config: str | None = None
    matformer_slice: str | None = None
    # The engine settings a model may hold apart from the server's (None: the server's flag):
    # an importance matrix for its in-situ quantization (a matrix fits one model's tensors),
    # its cached prefixes, the prefill rule and the KV-less reference path.
    imatrix: str | None = None
    prefix_cache_n: int | None = None
    max_decode_steps_before_prefill: int | None = None
    no_kv_cache: bool | None = None

    def __post_init__(self) -> None:
        if (self.matformer_config is None) != (self.matformer_slice is None):
            raise ValueError(
                "a MatFormer slice needs both the table and the slice name "
                "(--matformer-config FILE --matformer-slice NAME)"
            )
        if self.tool_call_parser not in (None, *PARSERS):
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(PARSERS)}; "
                f"got {self.tool_call_parser!r}"
            )
        if self.kind not in ("auto", *KINDS):
            raise ValueError(f"kind must be one of auto, {', '.join(KINDS)}; got {self.kind!r}")
        if self.in_situ_quant not in (None, "q8", "q4"):
            raise ValueError(f"in_situ_quant must be q8 or q4; got {self.in_situ_quant!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.kv_cache_dtype not in (None, *KV_CACHE_DTYPES):
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}"
            )
        _ = self.config_overrides  # a malformed one is refused here, at startup
        for name in ("max_seq_len", "max_seqs", "max_decode_steps_before_prefill"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value}")
        if self.prefix_cache_n is not None and self.prefix_cache_n < 0:
            raise ValueError(f"prefix_cache_n cannot be negative; got {self.prefix_cache_n}")

    @property
    def matformer(self) -> tuple[str, str] | None:
        """(slice table, slice name) of a MatFormer slice, or None."""
        if self.matformer_config is None or self.matformer_slice is None:
            return None
        return self.matformer_config, self.matformer_slice

    @property
    def config_overrides(self) -> dict[str, Any] | None:
        """``hf_config_overrides`` as an object; ValueError when it is not one."""
        if self.hf_config_overrides is None:
            return None
        try:
            value = json.loads(self.hf_config_overrides)
        except json.JSONDecodeError as exc:
            raise ValueError(f"hf_config_overrides is not JSON: {exc}") from None
        if not isinstance(value, dict):
            kind = type(value).__name__
            raise ValueError(f"hf_config_overrides must be a JSON object, got {kind}")
        return value

    @property
    def api_id(self) -> str:
        return self.alias or derived_id(self.model_id, self.filename)


def derived_id(model_id: str, filename: str | None = None) -> str:
    """The API id a source is served under when no alias is given."""
    if filename is not None:
        return Path(filename).stem
    if model_id in CATALOG and not Path(model_id).exists():
        return model_id
    path = Path(model_id).expanduser()
    if path.is_file():
        return path.stem
    if path.is_dir():
        return path.resolve().name
    return model_id


def load_models_file(path: str | Path) -> list[ModelSpec]:
    """Parse a models file (``.json``, or ``.toml``); SpecError lists every problem."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecError([f"cannot read the models file: {exc.strerror}"], str(path)) from None
    try:
        if path.suffix.lower() == ".toml":
            data: Any = tomllib.loads(raw.decode())
        else:
            data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        kind = "TOML" if path.suffix.lower() == ".toml" else "JSON"
        raise SpecError([f"not valid {kind}: {exc}"], str(path)) from None
    return parse_models(data, base=path.parent, origin=str(path))


def parse_models(data: Any, *, base: Path = Path(), origin: str = "") -> list[ModelSpec]:
    """Specs from an already-decoded models document; relative paths are against ``base``."""
    if not isinstance(data, dict):
        raise SpecError(
            [f"expected an object mapping labels to model entries, got {_type(data)}"], origin
        )
    if not data:
        raise SpecError(["no models: expected at least one label -> model entry"], origin)
    problems: list[str] = []
    specs = []
    for label, entry in data.items():
        spec = _parse_entry(str(label), entry, base, problems)
        if spec is not None:
            specs.append(spec)
    seen: dict[str, str] = {}  # API id -> the key path serving it
    for spec in specs:
        assert spec.label is not None
        other = seen.setdefault(spec.api_id, _path(spec.label))
        if other != _path(spec.label):
            problems.append(
                f"{_path(spec.label)}: serves under the API id {spec.api_id!r}, as "
                f"{other} does; give one of them an alias"
            )
    for spec in specs:  # adapters after every model: a model's id is never the adapter's fault
        assert spec.label is not None
        for name, _ in spec.lora:
            where = _path(spec.label, "lora", name)
            other = seen.setdefault(name, where)
            if other != where:
                problems.append(
                    f"{where}: serves under the API id {name!r}, as {other} does; rename one"
                )
    if problems:
        raise SpecError(problems, origin)
    return specs


def _parse_entry(label: str, entry: Any, base: Path, problems: list[str]) -> ModelSpec | None:
    start = len(problems)
    if not isinstance(entry, dict):
        problems.append(
            f"{_path(label)}: expected an object with one of {_kinds()}, got {_type(entry)}"
        )
        return None
    kinds = [k for k in entry if k in KINDS]
    unknown = [k for k in entry if k not in KINDS and k not in _SETTINGS]
    for key in unknown:
        problems.append(
            f"{_path(label, key)}: unknown key; expected one of {_kinds()} and optionally "
            f"{', '.join(_SETTINGS)}"
        )
    if len(kinds) != 1:
        found = f"found {', '.join(kinds)}" if kinds else "found none"
        problems.append(f"{_path(label)}: expected exactly one model kind ({_kinds()}); {found}")
        return None
    kind = kinds[0]
    body = entry[kind]
    if not isinstance(body, dict):
        problems.append(
            f"{_path(label, kind)}: expected an object with model_id, got {_type(body)}"
        )
        return None
    for key in body:
        if key not in _SOURCE_FIELDS and key not in _SETTINGS:
            problems.append(
                f"{_path(label, kind, key)}: unknown key; expected {', '.join(_SOURCE_FIELDS)} "
                f"or a setting ({', '.join(_SETTINGS)})"
            )
    settings: dict[str, tuple[Any, tuple[str, ...]]] = {}
    for name in _SETTINGS:
        if name in entry and name in body:
            problems.append(
                f"{_path(label, kind, name)}: also given at {_path(label, name)}; give it once"
            )
        elif name in entry:
            settings[name] = (entry[name], (label, name))
        elif name in body:
            settings[name] = (body[name], (label, kind, name))
    model_id, filename = _source(label, kind, body, problems)
    values: dict[str, Any] = {}
    for name, (value, where) in settings.items():
        values[name] = _setting(name, value, where, kind, base, problems)
    pair = ("matformer_config_path", "matformer_slice_name")
    if sum(values.get(k) is not None for k in pair) == 1:
        problems.append(f"{label}: {pair[0]} and {pair[1]} go together (a MatFormer slice)")
    if len(problems) > start or model_id is None:
        return None
    template = values.get("jinja_explicit") or values.get("chat_template")
    return ModelSpec(
        model_id=model_id,
        kind=kind,
        filename=filename,
        label=label,
        alias=values.get("alias"),
        chat_template=template,
        dtype=values.get("dtype"),
        in_situ_quant=values.get("in_situ_quant"),
        max_seq_len=values.get("max_seq_len"),
        max_seqs=values.get("max_seqs"),
        kv_cache_dtype=values.get("kv_cache_dtype"),
        hf_config_overrides=values.get("hf_config_overrides"),
        matformer_config=values.get("matformer_config_path"),
        matformer_slice=values.get("matformer_slice_name"),
        tool_call_parser=values.get("tool_call_parser"),
        mmproj=values.get("mmproj"),
        lora=values.get("lora") or (),
        imatrix=values.get("imatrix"),
        prefix_cache_n=values.get("prefix_cache_n"),
        max_decode_steps_before_prefill=values.get("max_decode_steps_before_prefill"),
        no_kv_cache=values.get("no_kv_cache"),
    )


def _source(
    label: str, kind: str, body: dict[str, Any], problems: list[str]
) -> tuple[str | None, str | None]:
    for key in _SOURCE_FIELDS:
        if key in body and (not isinstance(body[key], str) or not body[key].strip()):
            problems.append(
                f"{_path(label, kind, key)}: expected a non-empty string, got "
                f"{_describe(body[key])}"
            )
            return None, None
    model_id = body.get("model_id")
    quantized = body.get("quantized_model_id")
    filename = body.get("quantized_filename")
    if kind != "GGUF" and (quantized or filename):
        key = "quantized_model_id" if quantized else "quantized_filename"
        problems.append(f"{_path(label, kind, key)}: only GGUF entries take {key}")
        return None, None
    if model_id and quantized:
        problems.append(
            f"{_path(label, kind)}: give model_id or quantized_model_id + quantized_filename, "
            "not both"
        )
        return None, None
    if quantized and not filename:
        problems.append(
            f"{_path(label, kind, 'quantized_filename')}: required with quantized_model_id "
            "(the .gguf file inside it)"
        )
        return None, None
    if filename and not quantized:
        problems.append(
            f"{_path(label, kind, 'quantized_model_id')}: required with quantized_filename "
            "(the directory or store name that holds the file)"
        )
        return None, None
    source = model_id or quantized
    if not source:
        problems.append(
            f"{_path(label, kind, 'model_id')}: required: a store name "
            f"({', '.join(sorted(CATALOG))}), a file or a directory"
        )
        return None, None
    return source, filename


def _setting(
    name: str, value: Any, where: tuple[str, ...], kind: str, base: Path, problems: list[str]
) -> Any:
    path = _path(*where)
    if kind == "Embedding" and name in _GENERATIVE_ONLY:
        problems.append(f"{path}: does not apply to Embedding models")
        return None
    if name == "lora":
        return _adapters(value, base, path, problems)
    if name == "hf_config_overrides":
        if not isinstance(value, dict):
            problems.append(f"{path}: expected an object (merged into config.json)")
            return None
        return json.dumps(value)
    if name in ("max_seq_len", "max_seqs", "max_decode_steps_before_prefill", "prefix_cache_n"):
        least = 0 if name == "prefix_cache_n" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            wanted = "a non-negative integer (0: no prefix caching)" if least == 0 else None
            problems.append(
                f"{path}: expected {wanted or 'a positive integer'}, got {_describe(value)}"
            )
            return None
        return value
    if name == "no_kv_cache":
        if not isinstance(value, bool):
            problems.append(f"{path}: expected true or false, got {_describe(value)}")
            return None
        return value
    if not isinstance(value, str) or not value.strip():
        problems.append(f"{path}: expected a non-empty string, got {_describe(value)}")
        return None
    if name == "dtype" and value not in DTYPES:
        problems.append(f"{path}: expected one of {', '.join(DTYPES)}, got {value!r}")
        return None
    if name == "kv_cache_dtype" and value not in KV_CACHE_DTYPES:
        problems.append(f"{path}: expected one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}")
        return None
    if name == "tool_call_parser" and value not in PARSERS:
        problems.append(f"{path}: expected one of {', '.join(PARSERS)}, got {value!r}")
        return None
    if name == "in_situ_quant":
        method = ISQ_NAMES.get(value.strip().upper())
        if method is None:
            problems.append(
                f"{path}: expected q8 or q4 (or Q8_0, Q8K, Q4_0, Q4_1, Q4K), got {value!r}"
            )
        return method
    if name == "alias" and value == "default":
        problems.append(f"{path}: 'default' names the default model; choose another alias")
        return None
    if name == "mmproj":
        return _projector_file(Path(value), base, path, kind, problems)
    if name == "imatrix":
        return _existing_file(Path(value), base, path, "an importance matrix file", problems)
    if name == "matformer_config_path":
        return str(Path(value) if Path(value).is_absolute() else base / value)
    if name == "jinja_explicit":
        return _read_text(Path(value), base, path, problems)
    if name == "chat_template":
        return _template(value, base, path, problems)
    return value


def _adapters(
    value: Any, base: Path, path: str, problems: list[str]
) -> tuple[tuple[str, str], ...] | None:
    """``lora``: {name: directory} or ["NAME=PATH", ...] -> (name, directory) pairs, each a
    directory (relative paths against the models file's folder); the adapter files themselves
    are read and checked when the model loads."""
    pairs: list[tuple[str, Any, str]] = []  # (name, path, key path for messages)
    if isinstance(value, dict):
        pairs = [(str(k), v, f"{path}.{_path(str(k))}") for k, v in value.items()]
    elif isinstance(value, list):
        for i, item in enumerate(value):
            name, sep, folder = item.partition("=") if isinstance(item, str) else ("", "", "")
            if not sep or not name.strip() or not folder:
                problems.append(f'{path}[{i}]: expected "NAME=PATH", got {_describe(item)}')
                continue
            pairs.append((name.strip(), folder, f"{path}[{i}]"))
    else:
        problems.append(
            f"{path}: expected an object mapping adapter names to directories (or an array "
            f'of "NAME=PATH"), got {_type(value)}'
        )
        return None
    out: list[tuple[str, str]] = []
    start = len(problems)
    for name, folder, where in pairs:
        if name == "default":
            problems.append(f"{where}: 'default' names the default model; choose another name")
        elif any(name == seen for seen, _ in out):
            problems.append(f"{where}: the adapter name {name!r} is given twice")
        elif not isinstance(folder, str) or not folder.strip():
            problems.append(f"{where}: expected an adapter directory, got {_describe(folder)}")
        else:
            full = Path(folder).expanduser()
            full = full if full.is_absolute() else base / full
            if not full.is_dir():
                problems.append(f"{where}: expected a PEFT adapter directory; {full} is not one")
            out.append((name, str(full)))
    return tuple(out) if len(problems) == start else None


def read_chat_template(value: str) -> str:
    """``--chat-template``: Jinja source, a template file or a tokenizer_config.json, as the
    ``chat_template`` field of a models file takes it. ValueError when it cannot be read."""
    problems: list[str] = []
    template = _template(value, Path.cwd(), "--chat-template", problems)
    if template is None:
        raise ValueError("; ".join(problems))
    return template


def _template(value: str, base: Path, path: str, problems: list[str]) -> str | None:
    """A chat template given as Jinja source, a template file, or a tokenizer_config.json."""
    if "{{" in value or "{%" in value:
        return value
    text = _read_text(Path(value), base, path, problems)
    if text is None or not value.lower().endswith(".json"):
        return text
    try:
        template = json.loads(text).get("chat_template")
    except (ValueError, AttributeError):
        template = None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        problems.append(f"{path}: {value} has no string chat_template field")
        return None
    return template


def _projector_file(
    file: Path, base: Path, path: str, kind: str, problems: list[str]
) -> str | None:
    if kind != "GGUF":
        problems.append(f"{path}: only GGUF entries take a projector (mmproj)")
        return None
    return _existing_file(file, base, path, "a projector .gguf file", problems)


def _existing_file(file: Path, base: Path, path: str, what: str, problems: list[str]) -> str | None:
    """``file`` (relative to the models file's folder) if it is one; else a problem."""
    full = file.expanduser() if file.expanduser().is_absolute() else base / file
    if not full.is_file():
        problems.append(f"{path}: expected {what}; {full} is not a file")
        return None
    return str(full)


def _read_text(file: Path, base: Path, path: str, problems: list[str]) -> str | None:
    full = file.expanduser() if file.expanduser().is_absolute() else base / file
    try:
        return full.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        problems.append(f"{path}: expected a readable template file; {full}: {reason}")
        return None


_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _path(*parts: str) -> str:
    return ".".join(p if _PLAIN_KEY.match(p) else json.dumps(p) for p in parts)


def _kinds() -> str:
    return ", ".join(KINDS)


def _type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    for t, name in names.items():
        if isinstance(value, t):
            return name
    return "a number" if isinstance(value, int | float) else type(value).__name__


def _describe(value: Any) -> str:
    if isinstance(value, str | int | float | bool) or value is None:
        return f"{_type(value)} {json.dumps(value)}"
    return _type(value)
