"""Gemma 4's decoder (models/gemma4.py) against transformers' Gemma4ForCausalLM on tiny random
checkpoints (tests/models/tiny_gemma4.py): float32 logits of a prompt past the sliding window,
whole and in chunks through the paged cache, and the greedy continuation.

Two shapes: ``full``, with every part Gemma 4 adds (global layers of another head size and
key/value count reading values from the keys' projection, proportional RoPE, K/V-sharing
layers with double-wide MLPs, per-layer embeddings); ``plain``, the same layers with value
projections everywhere, no sharing, no PLE and plain RoPE on the global layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from inferd import LLM, SamplingParams
from inferd.engine.runner import ModelRunner
from inferd.loading.hf_model import load_safetensors_model
from inferd.models.config import ModelConfigError, config_from_hf
from inferd.models.gemma4 import Gemma4ForCausalLM
from inferd.models.llama import LlamaForCausalLM
from inferd.serving.sizing import kv_shape
from tests.models.test_llama_parity import full_forward
from tests.models.tiny import VOCAB
from tests.models.tiny_gemma4 import WINDOW, save_tiny_gemma4_text, text_config

LOGIT_TOLERANCE = 1e-4  # float32 on both sides: only summation order differs
PROMPT = torch.randint(3, VOCAB, (23,), generator=torch.Generator().manual_seed(4)).tolist()
SHAPES: dict[str, dict[str, Any]] = {
    "full": {},
    "plain": dict(
        attention_k_eq_v=False,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
        },
    ),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Any, LlamaForCausalLM]:
    directory: Path = tmp_path_factory.mktemp(f"gemma4_{request.param}")
    hf = save_tiny_gemma4_text(directory, **SHAPES[request.param])
    ours, _ = load_safetensors_model(directory, torch.float32, progress=False)
    return request.param, hf, ours


def test_config_reads_each_layers_shape(pair: tuple[str, Any, LlamaForCausalLM]) -> None:
    shape, _, ours = pair
    cfg = ours.config
    assert isinstance(ours, Gemma4ForCausalLM) and cfg.gemma4 is not None
    assert cfg.sliding_layers == (0, 2, 4) and cfg.sliding_window == WINDOW
    assert [cfg.kv_shape(i) for i in range(2)] == [(2, 16), (1 if shape == "full" else 2, 32)]
    if shape == "full":  # layers 4 and 5 read the last sliding and global layers before them
        assert [cfg.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 2, 3]
        assert cfg.gemma4.k_eq_v and cfg.gemma4.per_layer_size == 8
        assert cfg.gemma4.global_rotary_fraction == 0.25
    else:
        assert [cfg.kv_source(i) for i in range(6)] == list(range(6))
        assert cfg.gemma4.per_layer_size == 0 and cfg.gemma4.global_rotary_fraction == 1.0
    assert cfg.final_softcap == 30.0 and cfg.attention_scale == 1.0


@pytest.mark.parametrize("chunk", [None, 5])
def test_f32_logits_match_transformers(
    pair: tuple[str, Any, LlamaForCausalLM], chunk: int | None
) -> None:
    _, hf, ours = pair
    assert len(PROMPT) > WINDOW  # the window hides keys from the later tokens
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    logits = full_forward(ours, PROMPT, block_size=4, chunk=chunk)
    assert (logits - expected).abs().max() < LOGIT_TOLERANCE
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_greedy_tokens_match_transformers(pair: tuple[str, Any, LlamaForCausalLM]) -> None:
    _, hf, ours = pair
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)
    expected = out[0, len(PROMPT) :].tolist()
    ids = list(PROMPT)
    for _ in range(8):
        ids.append(int(full_forward(ours, ids, block_size=4)[-1].argmax()))
    assert ids[len(PROMPT) :] == expected


def test_mixture_of_experts_is_refused_with_a_clear_message() -> None:
    hf = text_config(enable_moe_block=True, num_experts=4, top_k_experts=2).to_dict()
    with pytest.raises(ModelConfigError, match="mixture-of-experts"):
        config_from_hf(hf)


def test_engine_greedy_matches_transformers(tmp_path: Path) -> None:
    """Through the engine (paged cache at each layer's shape, chunked prefill, decode steps
    past the window), the greedy reply is transformers'."""
    hf = save_tiny_gemma4_text(tmp_path)
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False)
    config = dict(dtype="f32", block_size=4, kv_cache_tokens=256, max_num_batched_tokens=8)
    with LLM(str(tmp_path), **config) as llm:
        reply = llm.generate(
            [PROMPT], SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False
        )
    assert list(reply[0].outputs[0].token_ids) == out[0, len(PROMPT) :].tolist()


def test_kv_sharing_layers_hold_no_cache_of_their_own(tmp_path: Path) -> None:
    """The engine's pool: layers 4 and 5 use the caches of layers 2 and 3, and the sizing
    counts the four layers that keep keys and values (two sliding of 2 x 16, two global of
    1 x 32 values a token, each for K and V, float32)."""
    save_tiny_gemma4_text(tmp_path)
    model, cfg = load_safetensors_model(tmp_path, torch.float32, progress=False)
    caches = ModelRunner(model, cfg, 16, 4, torch.float32).kv_caches
    assert caches[4] is caches[2] and caches[5] is caches[3]
    assert caches[1][0].shape == (16, 4, 1, 32) and caches[0][0].shape == (16, 4, 2, 16)
    assert kv_shape(cfg, 4).bytes_per_token == 2 * (2 * 2 * 16 + 2 * 1 * 32) * 4


def test_lora_targets_are_refused_with_a_clear_message(
    pair: tuple[str, Any, LlamaForCausalLM],
) -> None:
    with pytest.raises(ModelConfigError, match="LoRA adapters on gemma4"):
        pair[2].lora_target(0, "q_proj")
