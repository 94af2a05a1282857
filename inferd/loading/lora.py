"""PEFT LoRA adapters: read, checked against the base model, then attached to its projections.

An adapter is a directory with ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's
format). Only safetensors are read: a ``.bin`` adapter is a pickle, which can run code when
loaded, so it is refused. Every tensor is read and checked (names, ranks, shapes against the
base model's projections) before anything is attached, so a bad adapter leaves the model as it
was. The update ``x @ A^T @ B^T`` is scaled by ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
rsLoRA), as PEFT does.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inferd.layers.linear import Linear
from inferd.layers.lora import LoraDelta, LoraSlot
from inferd.loading.safetensors import SafetensorsError, SafetensorsFile
from inferd.models.config import ModelConfigError
from inferd.models.llama import LlamaForCausalLM

DEFAULT_MAX_LORA_RANK = 64
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# An adapter's name becomes a model id (in /v1/models, logs, metrics labels): an identifier.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_CONFIG_BYTES = 1 << 20  # PEFT writes a few hundred bytes
MAX_CONFIG_DEPTH = 32  # PEFT's configs nest two levels; json's parser recurses per level


class LoraError(ValueError):
    """An adapter that cannot be served: the message names it and what is wrong."""


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    path: Path
    rank: int
    scale: float
    # (layer, target such as "q_proj") -> (A [rank, in], B [out, rank]) in float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str  # sha256 of the config and weights files

    @property
    def key(self) -> str:
        """What rows and prefix-cache hashes name it by: the name and the files' digest, so
        other weights loaded later under the same name never hit this one's cached blocks."""
        return f"{self.name}@{self.digest[:16]}"


def read_adapter(
    name: str, path: str | Path, model: LlamaForCausalLM, max_rank: int = DEFAULT_MAX_LORA_RANK
) -> LoraAdapter:
    """Read and check the adapter at ``path`` for ``model``; raises LoraError naming ``name``."""
    check_name(name)
    root = Path(path)
    try:
        return _read(name, root, model, max_rank)
    except (LoraError, SafetensorsError, ModelConfigError, OSError, ValueError) as exc:
        message = str(exc)
        raise LoraError(f"LoRA adapter {name!r} ({root}): {message}") from None


def check_name(name: object) -> str:
    """An adapter name is an identifier of at most 64 characters (letters, digits, ``.``,
    ``_``, ``-``; a letter or digit first): it is shown as a model id. LoraError otherwise."""
    if not isinstance(name, str) or NAME_PATTERN.fullmatch(name) is None:
        shown = repr(name[:64]) if isinstance(name, str) else type(name).__name__
        raise LoraError(
            f"LoRA adapter name {shown} is not valid: use 1 to 64 letters, digits, '.', '_' "
            "or '-', starting with a letter or digit"
        )
    return name


def _read(name: str, root: Path, model: LlamaForCausalLM, max_rank: int) -> LoraAdapter:
    if not root.is_dir():
        raise LoraError("no such directory")
    weights_file = root / WEIGHTS_FILE
    if not weights_file.is_file():
        if (root / "adapter_model.bin").is_file():
            raise LoraError(
                "only adapter_model.bin (a pickle, unsafe to load) is there; "
                "only adapter_model.safetensors is accepted"
            )
        raise LoraError(f"no {WEIGHTS_FILE}")
    if not (root / CONFIG_FILE).is_file():
        raise LoraError(f"no {CONFIG_FILE}")
    with open(root / CONFIG_FILE, "rb") as f:
        config_bytes = f.read(MAX_CONFIG_BYTES + 1)
    rank, scale = _rank_and_scale(parse_config(config_bytes), max_rank)
    weights = _read_weights(SafetensorsFile(weights_file), model, rank)
    digest = hashlib.sha256(config_bytes)
    with open(weights_file, "rb") as f:
        hashlib.file_digest(f, lambda: digest)
    return LoraAdapter(name, root, rank, scale, weights, digest.hexdigest())


def parse_config(data: bytes) -> dict[str, Any]:
    """``adapter_config.json`` as an object: at most 1 MiB, nested at most 32 deep (measured
    before parsing: json's parser recurses once per level), numbers finite (json takes
    ``NaN``/``Infinity`` and reads ``1e309`` as infinity)."""
    if len(data) > MAX_CONFIG_BYTES:
        raise LoraError(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise LoraError(f"{CONFIG_FILE} is not UTF-8 text") from None
    if _nesting(text) > MAX_CONFIG_DEPTH:
        raise LoraError(f"{CONFIG_FILE} is nested more than {MAX_CONFIG_DEPTH} levels deep")

    def no_constant(word: str) -> float:
        raise LoraError(f"{CONFIG_FILE} holds {word}, which is not a JSON number")

    try:
        config = json.loads(text, parse_constant=no_constant)
    except json.JSONDecodeError as exc:
        raise LoraError(f"{CONFIG_FILE} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(config, dict):
        raise LoraError(f"{CONFIG_FILE} must hold a JSON object")
    return config


def _nesting(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON text (brackets inside strings are
    skipped); an upper bound for malformed text, which the parser then refuses."""
    depth = deepest = 0
    for token in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[{]|[\]}]', text):
        mark = token.group()
        if mark in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif mark in "]}":
            depth -= 1
    return deepest


def _rank_and_scale(config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """The adapter's rank and update scale; refuses what this loader does not serve."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"peft_type {config.get('peft_type')!r} is not LORA")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_pattern"):
        if config.get(key):
            raise LoraError(f"{key} is not supported")
    if config.get("use_dora"):
        raise LoraError("DoRA adapters are not supported")
    if config.get("bias", "none") != "none":
        raise LoraError(f"bias={config.get('bias')!r} is not supported (only 'none')")
    if config.get("fan_in_fan_out"):
        raise LoraError("fan_in_fan_out is not supported")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:  # true is no rank
        raise LoraError(f"r must be a positive integer, got {_shown(rank)}")
    if rank > max_rank:
        raise LoraError(f"rank {rank} is above --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoraError(f"lora_alpha must be a finite number, got {_shown(alpha)}")
    denominator = math.sqrt(rank) if config.get("use_rslora") else rank
    return rank, float(alpha) / denominator


def _shown(value: object) -> str:
    return repr(value)[:40]


def _read_weights(
    file: SafetensorsFile, model: LlamaForCausalLM, rank: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name in file.names():
        match = _TENSOR.search(tensor_name)
        if match is None:
            raise LoraError(f"tensor {tensor_name!r} is not a LoRA A/B of a layer's projection")
        layer, target, half = int(match[1]), match[2], match[3]
        if layer >= model.config.num_layers:
            raise LoraError(f"{tensor_name}: the base model has {model.config.num_layers} layers")
        halves.setdefault((layer, target), {})[half] = file.load_tensor(tensor_name)
    if not halves:
        raise LoraError("no LoRA tensors")
    weights = {}
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoraError(f"layer {layer} {target}: lora_A and lora_B must both be present")
        linear, _, width = model.lora_target(layer, target)
        a, b = pair["A"], pair["B"]
        want_a, want_b = (rank, linear.in_features), (width, rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise LoraError(
                f"layer {layer} {target}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit "
                f"the base model (want A {want_a}, B {want_b}); an adapter for another model?"
            )
        a, b = a.float().contiguous(), b.float().contiguous()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoraError(f"layer {layer} {target}: the weights hold NaN or infinite values")
        weights[(layer, target)] = (a, b)
    return weights


def attach(model: LlamaForCausalLM, adapter: LoraAdapter) -> None:
    """Make ``adapter.key`` runnable on ``model`` (rows choose it with ``layers.lora_rows``)."""
    detach(model, adapter.key)
    for (layer, target), (a, b) in adapter.weights.items():
        linear, start, _ = model.lora_target(layer, target)
        if linear.lora is None:
            linear.lora = LoraSlot()
        linear.lora.put(adapter.key, LoraDelta(a, b, adapter.scale, start))


def detach(model: LlamaForCausalLM, key: str) -> None:
    """Remove the adapter ``key`` from every projection; one left with none pays nothing."""
    for module in model.modules():
        if isinstance(module, Linear) and module.lora is not None:
            module.lora.pop(key)
            if not module.lora.deltas:
                module.lora = None
