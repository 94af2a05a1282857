"""Our BERT encoder + pooling against transformers on the real all-MiniLM-L6-v2, plus the
safetensors reader and pooling modes on small tensors."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from inferd.engine.embedding import EmbeddingInputError, EmbeddingModel, Pooling
from inferd.loading.safetensors import SafetensorsCheckpoint, SafetensorsError
from inferd.serving.loading import load_embedding_model
from inferd.source import resolve_source

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "A",
    "Ünïcödé, accents and ß — all lower-cased by the normalizer?",
    "机器学习很有趣。",
    "emoji 🚀🔥 and symbols: <>&%$#@!",
    "numbers 3.14159 2718 1e-10 and code: def f(x): return x ** 2",
    "  leading and trailing whitespace  \n\t",
    " ".join(["a long passage about embeddings and sentence similarity"] * 45),
]


@pytest.fixture(scope="module")
def ours(minilm_dir: Path) -> Iterator[EmbeddingModel]:
    model = load_embedding_model(resolve_source(str(minilm_dir)))
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(minilm_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(minilm_dir))


def _reference_vector(reference: tuple[Any, Any], text: str) -> torch.Tensor:
    model, tokenizer = reference
    batch = tokenizer([text], return_tensors="pt", truncation=False)
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / mask.sum(1)
    return F.normalize(mean, dim=-1)[0]


def test_tokens_match_the_reference_tokenizer(
    ours: EmbeddingModel, reference: tuple[Any, Any]
) -> None:
    _, tokenizer = reference
    for text, ids in zip(TEXTS, ours.tokenize(TEXTS), strict=True):
        assert ids == tokenizer(text, truncation=False)["input_ids"], text


def test_batched_vectors_match_transformers(
    ours: EmbeddingModel, reference: tuple[Any, Any]
) -> None:
    """One padded batch of varied lengths against unpadded single runs of transformers."""
    vectors = ours.embed(ours.tokenize(TEXTS))
    assert len(vectors) == len(TEXTS)
    for text, vec in zip(TEXTS, vectors, strict=True):
        got = torch.tensor(vec)
        want = _reference_vector(reference, text)
        assert got.shape == (384,)
        assert torch.dot(got, want).item() == pytest.approx(1.0, abs=1e-4), text
        assert torch.linalg.vector_norm(got).item() == pytest.approx(1.0, abs=1e-5)
        assert (got - want).abs().max().item() < 1e-4, text


def test_padding_does_not_change_a_vector(ours: EmbeddingModel) -> None:
    ids = ours.tokenize(TEXTS)
    alone = ours.embed([ids[0]])[0]
    padded = ours.embed(ids)[0]  # the same input beside much longer ones
    assert max(abs(a - b) for a, b in zip(alone, padded, strict=True)) < 1e-5


def test_sub_batches_keep_input_order(ours: EmbeddingModel) -> None:
    ids = ours.tokenize(TEXTS)
    whole = ours.embed(ids)
    ours.sub_batch = 2
    try:
        split = ours.embed(ids)
    finally:
        ours.sub_batch = 32
    for a, b in zip(whole, split, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


def test_pooling_config_of_the_model(ours: EmbeddingModel) -> None:
    assert ours.pooling == Pooling(modes=("mean_tokens",), normalize=True)
    assert ours.dimensions == 384
    assert ours.max_model_len == 512


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], "input is empty"),
        ([101] + [1000] * 511 + [102], "has 513 tokens, but minilm takes at most 512"),
        ([101, 30522, 102], "token id 30522, outside this model's vocabulary [0, 30522)"),
        ([101, -1, 102], "token id -1"),
    ],
)
def test_bad_inputs_are_named(ours: EmbeddingModel, ids: list[int], message: str) -> None:
    with pytest.raises(EmbeddingInputError, match=re.escape(message)):
        ours.embed([ids])


def test_longest_allowed_input_embeds(ours: EmbeddingModel) -> None:
    (vec,) = ours.embed([[101] + [1000] * 510 + [102]])
    assert len(vec) == 384


# -- pooling modes ------------------------------------------------------------------------------
def _pooling_dir(tmp_path: Path, config: dict[str, bool], normalize: bool) -> Path:
    modules = [
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_pooling_modes_follow_the_config(tmp_path: Path) -> None:
    hidden = torch.tensor([[[1.0, 2.0], [3.0, -4.0], [100.0, 100.0]]])  # last position: padding
    mask = torch.tensor([[1, 1, 0]])
    cfg = {
        "pooling_mode_cls_token": True,
        "pooling_mode_max_tokens": True,
        "pooling_mode_mean_tokens": True,
    }
    pooling = Pooling.from_directory(_pooling_dir(tmp_path, cfg, normalize=False))
    assert pooling.modes == ("cls_token", "max_tokens", "mean_tokens")
    assert pooling(hidden, mask).tolist() == [[1.0, 2.0, 3.0, 2.0, 2.0, -1.0]]


def test_pooling_without_sentence_transformers_files(tmp_path: Path) -> None:
    assert Pooling.from_directory(tmp_path) == Pooling(("mean_tokens",), normalize=True)


def test_unsupported_pooling_mode_is_refused(tmp_path: Path) -> None:
    cfg = {"pooling_mode_weightedmean_tokens": True}
    with pytest.raises(ValueError, match="pooling mode weightedmean_tokens is not supported"):
        Pooling.from_directory(_pooling_dir(tmp_path, cfg, normalize=True))


# -- safetensors --------------------------------------------------------------------------------
def test_safetensors_single_file_and_sharded_index(tmp_path: Path) -> None:
    a, b = torch.arange(6, dtype=torch.float32).view(2, 3), torch.ones(4, dtype=torch.bfloat16)
    save_file({"a": a}, str(tmp_path / "model-1.safetensors"))
    save_file({"b": b}, str(tmp_path / "model-2.safetensors"))
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert sorted(ckpt.names()) == ["a", "b"]
    assert ckpt.shape("a") == (2, 3)
    assert torch.equal(ckpt.load_tensor("a"), a)
    loaded_b = ckpt.load_tensor("b")
    assert loaded_b.dtype == torch.bfloat16 and torch.equal(loaded_b, b)
    single = SafetensorsCheckpoint(tmp_path / "model-1.safetensors")
    assert single.names() == ["a"]
    with pytest.raises(SafetensorsError, match="no tensor named 'b'"):
        single.load_tensor("b")


def test_safetensors_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(SafetensorsError, match="no such file or directory"):
        SafetensorsCheckpoint(tmp_path / "missing")
    with pytest.raises(SafetensorsError, match=re.escape("no .safetensors files")):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SafetensorsError, match="not a readable safetensors file"):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    index = {"weight_map": {"a": "gone.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        SafetensorsError, match=re.escape("shards listed but missing: gone.safetensors")
    ):
        SafetensorsCheckpoint(tmp_path)


def test_duplicate_tensors_across_shards_are_refused(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(1)}, str(tmp_path / "x.safetensors"))
    save_file({"a": torch.ones(1)}, str(tmp_path / "y.safetensors"))
    with pytest.raises(
        SafetensorsError, match=re.escape("tensor 'a' is in both x.safetensors and y")
    ):
        SafetensorsCheckpoint(tmp_path)
