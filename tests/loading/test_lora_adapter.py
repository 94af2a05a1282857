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
