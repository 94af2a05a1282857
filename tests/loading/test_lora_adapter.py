"""Adapters that cannot be served are refused with a message naming them; nothing is attached."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from inferd.loading.hf_model import load_safetensors_model
from inferd.loading.lora import LoraError, attach, read_adapter
from inferd.models.llama import LlamaForCausalLM
from tests.models.lora_tiny import save_random_adapter
from tests.models.tiny import save_tiny


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("bad_lora")
    save_tiny("llama", root / "base")
    save_random_adapter(save_tiny("llama", root / "hf"), root / "good", rank=8, seed=1)
    wide = save_tiny("llama", root / "wide", hidden_size=128)  # another base model
    save_random_adapter(wide, root / "other", rank=8, seed=2)
    save_random_adapter(save_tiny("llama", root / "hf2"), root / "r16", rank=16, seed=3)
    model, _ = load_safetensors_model(root / "base", torch.float32, progress=False)
    return root, model


def _no_lora(model: LlamaForCausalLM) -> bool:
    return all(getattr(m, "lora", None) is None for m in model.modules())


def _refused(name: str, path: Path, model: LlamaForCausalLM, max_rank: int = 64) -> str:
    with pytest.raises(LoraError) as err:
        read_adapter(name, path, model, max_rank)
    assert name in str(err.value)
    assert _no_lora(model)
    return str(err.value)


def test_good_adapter_reads(made: Any) -> None:
    root, model = made
    adapter = read_adapter("good", root / "good", model)
    assert adapter.rank == 8 and len(adapter.weights) == 7 * model.config.num_layers


def test_adapter_for_another_base(made: Any) -> None:
    root, model = made
    assert "another model" in _refused("other", root / "other", model)


def test_missing_files(made: Any, tmp_path: Path) -> None:
    root, model = made
    assert "no such directory" in _refused("gone", tmp_path / "nothing", model)
    shutil.copytree(root / "good", tmp_path / "noconf")
    (tmp_path / "noconf" / "adapter_config.json").unlink()
    assert "adapter_config.json" in _refused("noconf", tmp_path / "noconf", model)


def test_pickle_only_is_refused(made: Any, tmp_path: Path) -> None:
    root, model = made
    (tmp_path / "pkl").mkdir()
    shutil.copy(root / "good" / "adapter_config.json", tmp_path / "pkl")
    torch.save({"x": torch.zeros(1)}, tmp_path / "pkl" / "adapter_model.bin")
    assert "pickle" in _refused("pkl", tmp_path / "pkl", model)


def test_rank_above_max(made: Any) -> None:
    root, model = made
    assert "--max-lora-rank 8" in _refused("r16", root / "r16", model, max_rank=8)


def test_unsupported_config(made: Any, tmp_path: Path) -> None:
    root, model = made
    shutil.copytree(root / "good", tmp_path / "dora")
    config = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    assert "DoRA" in _refused("dora", tmp_path / "dora", model)


def test_refused_after_attached_leaves_the_first(made: Any) -> None:
    root, model = made
    good = read_adapter("good", root / "good", model)
    attach(model, good)
    with pytest.raises(LoraError):
        read_adapter("other", root / "other", model)
    slots = [m.lora for m in model.modules() if getattr(m, "lora", None) is not None]
    assert slots and all(set(s.deltas) == {good.key} for s in slots)


def test_the_key_follows_the_files_not_only_the_name(made: Any, tmp_path: Path) -> None:
    """Rows and prefix-cache hashes name an adapter by its key: other weights loaded later
    under the same name must not reach the blocks the first one cached."""
    root, model = made
    first = read_adapter("ad", root / "good", model)
    assert read_adapter("ad", root / "good", model).key == first.key
    save_random_adapter(save_tiny("llama", tmp_path / "hf"), tmp_path / "new", rank=8, seed=9)
    assert read_adapter("ad", tmp_path / "new", model).key != first.key
    assert first.key.startswith("ad@")


def _with_config(root: Path, dst: Path, text: str) -> Path:
    """The good adapter's weights under ``dst`` with ``text`` as its adapter_config.json."""
    shutil.copytree(root / "good", dst)
    (dst / "adapter_config.json").write_text(text)
    return dst


def _slots(model: LlamaForCausalLM) -> list[set[str]]:
    return [set(m.lora.deltas) for m in model.modules() if getattr(m, "lora", None) is not None]


def _refused_unchanged(name: str, path: Path, model: LlamaForCausalLM) -> str:
    """Refused naming ``name``; the model's attached adapters as they were (another test of
    this module attaches one to the shared model)."""
    before = _slots(model)
    with pytest.raises(LoraError) as err:
        read_adapter(name, path, model)
    assert name in str(err.value) and _slots(model) == before
    return str(err.value)


def _good_config(root: Path, **changes: Any) -> str:
    config = json.loads((root / "good" / "adapter_config.json").read_text())
    return json.dumps(config | changes)


def test_hostile_configs_are_refused_with_a_short_message(made: Any, tmp_path: Path) -> None:
    """A config nested 100k deep (json's parser would raise RecursionError), NaN, Infinity or
    1e309 as lora_alpha, ``"r": true``, and a config that is not an object: each a LoraError
    naming the adapter, never another exception, before any weight is attached."""
    root, model = made
    good = _good_config(root)
    cases = {
        "deep": ("[" * 100_000 + "]" * 100_000, "nested more than 32"),
        "deep_value": (good[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}", "nested"),
        "nan": (good.replace('"lora_alpha": 16', '"lora_alpha": NaN'), "NaN"),
        "inf": (good.replace('"lora_alpha": 16', '"lora_alpha": Infinity'), "Infinity"),
        "big": (good.replace('"lora_alpha": 16', '"lora_alpha": 1e309'), "finite"),
        "rtrue": (_good_config(root, r=True), "r must be a positive integer, got True"),
        "alpha_true": (_good_config(root, lora_alpha=True), "lora_alpha must be a finite"),
        "list": ("[1, 2]", "must hold a JSON object"),
        "broken": ('{"r": 8,', "not valid JSON"),
    }
    assert '"lora_alpha": 16' in good
    for name, (text, reason) in cases.items():
        message = _refused_unchanged(name, _with_config(root, tmp_path / name, text), model)
        assert reason in message, (name, message)
        assert len(message) < 400, name


def test_non_finite_weights_are_refused(made: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    root, model = made
    shutil.copytree(root / "good", tmp_path / "nanw")
    weights_file = tmp_path / "nanw" / "adapter_model.safetensors"
    tensors = load_file(str(weights_file))
    first = sorted(tensors)[0]
    tensors[first][0, 0] = float("nan")
    save_file(tensors, str(weights_file))
    assert "NaN or infinite" in _refused_unchanged("nanw", tmp_path / "nanw", model)


@pytest.mark.parametrize("name", ["", "a b", "x" * 65, "<script>", "-lead", "../up", "é"])
def test_names_must_be_identifiers(made: Any, name: str) -> None:
    root, model = made
    before = _slots(model)
    with pytest.raises(LoraError, match="is not valid"):
        read_adapter(name, root / "good", model)
    assert _slots(model) == before
