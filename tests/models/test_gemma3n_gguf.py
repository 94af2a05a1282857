"""Gemma 3n as llama.cpp ships it (loading/gguf_gemma3n.py): the tiny random
Gemma3nForConditionalGeneration converted by llama.cpp's own convert_hf_to_gguf.py into a
language model GGUF (f32, f16, Q8_0), against the same checkpoint read as a Hugging Face
directory (whose parity with transformers tests/models/test_gemma3n_parity.py proves).

The checkpoint's weights lie on Q8_0's grid, so every file holds exactly its values: each file
gives the directory's decoder config (its AltUp, Laurel, per-layer MLP widths, sparse gates'
cut-offs and per-layer embedding vocabulary recovered from the converter's forms) and every one
of its decoder's parameters (the stacked AltUp projections taken apart, the per-layer table's
zero padding dropped), the same ids of text and chat template; the engine's prompt ids, greedy
tokens and the log-probabilities of every prompt and reply token equal the directory's. The
media tables and the audio encoder are not in the file (the converter writes Gemma 3n's to a
projector, and cannot), so the model reads text alone."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.loading.gguf import GGUFFile
from inferd.loading.hf_layout import GEMMA_MEDIA_MODULES
from inferd.loading.model import LoadedModel, load
from inferd.models.config import ModelConfig
from inferd.models.gemma3n import Gemma3nForCausalLM
from inferd.serving.served import ServedModel, load_model
from tests.models.test_gemma4_gguf import (
    LOGPROB_TOLERANCE,
    assert_same_text_handling,
    greedy_run,
)
from tests.models.tiny_gemma3n import MM_TEXT, TinyGemma3nGguf

TEXTS = [
    "Hello world",
    "  two spaces, a tab\tand\n\nnewlines\n",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n",
    "Émile 三个字 🙂 <0x41> ▁ <start_of_turn>user\n<image_soft_token><end_of_turn>",
    "<bos>The quick brown fox<end_of_turn><start_of_audio><audio_soft_token><end_of_audio>",
]
# Longer than the sliding window of 8; the random model's greedy reply to it stays in text ids.
QUESTION = "A lighthouse keeper watched the storm roll in over the grey sea."


@pytest.fixture(scope="module")
def directory(tiny_gemma3n_gguf: TinyGemma3nGguf) -> LoadedModel:
    return load(tiny_gemma3n_gguf.directory, dtype="f32", progress=False)


def _text_decoder(hf: ModelConfig) -> ModelConfig:
    """The directory's decoder less its media: what a language model GGUF describes."""
    assert hf.gemma3n is not None
    text = replace(hf.gemma3n, unserved_media=(), media_vocab=())
    return replace(hf, gemma3n=text, gemma3n_audio=None)


def _same_config(gguf: ModelConfig, hf: ModelConfig) -> bool:
    """Equal but for what the file stores in float32: the norms' epsilon (1e-6 reads back as
    9.99999997e-07) and the sparse layers' targets (stored as their gaussian cut-offs)."""
    assert gguf.gemma3n is not None and hf.gemma3n is not None
    assert abs(gguf.rms_norm_eps - hf.rms_norm_eps) < 1e-12
    np.testing.assert_allclose(gguf.gemma3n.sparsity, hf.gemma3n.sparsity, rtol=0, atol=1e-8)
    layers = replace(gguf.gemma3n, sparsity=hf.gemma3n.sparsity)
    return replace(gguf, rms_norm_eps=hf.rms_norm_eps, gemma3n=layers) == hf


@pytest.mark.parametrize("lm", ["lm-f32", "lm-f16", "lm-q8_0"])
def test_each_file_holds_the_directory_decoder(
    tiny_gemma3n_gguf: TinyGemma3nGguf, directory: LoadedModel, lm: str
) -> None:
    path = tiny_gemma3n_gguf.files[lm]
    stored = {i.qtype for i in GGUFFile(path).tensor_infos()}
    kind = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0"}[lm.removeprefix("lm-")]
    assert GGMLQuantizationType[kind] in stored  # the file is of the type it is named for
    ours = load(path, dtype="f32", progress=False, packed_kernels=False)
    assert type(ours.model) is Gemma3nForCausalLM
    assert ours.config.input_modalities == ("text",)
    assert _same_config(ours.config, _text_decoder(directory.config))
    # the sparse gates' cut-offs, which the model computes from the targets, are the same
    cutoffs = [layer.mlp.multiplier for layer in ours.model.layers]
    assert cutoffs == [layer.mlp.multiplier for layer in directory.model.layers]
    assert cutoffs[0] is not None and cutoffs[-1] is None
    theirs = dict(directory.model.named_parameters())
    params = dict(ours.model.named_parameters())
    media = {n for n in theirs if n.startswith(GEMMA_MEDIA_MODULES)}
    assert media and params.keys() == theirs.keys() - media
    for name, value in params.items():
        assert torch.equal(value, theirs[name]), name
    assert_same_text_handling(ours, directory, path, TEXTS)


@pytest.fixture(scope="module")
def engines(tiny_gemma3n_gguf: TinyGemma3nGguf) -> Iterator[tuple[ServedModel, ServedModel]]:
    """The Q8_0 language model and the directory."""
    cfg = EngineConfig(dtype="f32", kv_cache_tokens=2048, max_model_len=512)
    files = tiny_gemma3n_gguf.files
    from_gguf = load_model(files["lm-q8_0"], cfg, progress=False, loop=CallerLoop())
    from_hf = load_model(tiny_gemma3n_gguf.directory, cfg, progress=False, loop=CallerLoop())
    yield from_gguf, from_hf
    from_gguf.shutdown()
    from_hf.shutdown()


def test_the_engine_reads_text_as_the_directory(
    engines: tuple[ServedModel, ServedModel],
) -> None:
    from_gguf, from_hf = engines
    assert from_gguf.modalities["input"] == ["text"]
    assert from_hf.modalities["input"] == ["text", "audio"]
    content = [{"type": "text", "text": QUESTION}]
    ids, tokens, logprobs = greedy_run(from_gguf, content, [])
    want_ids, want_tokens, want_logprobs = greedy_run(from_hf, content, [])
    # A reply in text ids: the directory embeds a media id by its encoder's table, which the
    # file lacks (the random model picks some for other prompts).
    assert max(want_tokens) < MM_TEXT
    assert (ids, tokens) == (want_ids, want_tokens)
    assert len(ids) > 8 and len(logprobs) == len(ids) - 1 + len(tokens)
    np.testing.assert_allclose(logprobs, want_logprobs, atol=LOGPROB_TOLERANCE)
