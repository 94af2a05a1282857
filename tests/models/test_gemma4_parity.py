"""Gemma 4's decoder (models/gemma4.py) against transformers' Gemma4ForCausalLM on tiny random
checkpoints (tests/models/tiny_gemma4.py): float32 logits of a prompt past the sliding window,
whole and in chunks through the paged cache, and the greedy continuation.

Three shapes: ``full``, with every part Gemma 4 adds (global layers of another head size and
key/value count reading values from the keys' projection, proportional RoPE, K/V-sharing
layers with double-wide MLPs, per-layer embeddings); ``plain``, the same layers with value
projections everywhere, no sharing, no PLE and plain RoPE on the global layers; ``moe``, the
full shape with a mixture of experts beside each layer's MLP (26B-A4B's ``enable_moe_block``:
2 of 4 experts a token), whose routing must really route (top-1 routing moves the logits),
also under Gemma4ForConditionalGeneration, and whose router picks and weighs as transformers'
does in bf16, bit for bit."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from inferd import LLM, SamplingParams
from inferd.engine.runner import ModelRunner
from inferd.loading.hf_model import load_safetensors_model
from inferd.models.config import ModelConfigError, config_from_hf
from inferd.models.gemma4 import Gemma4ForCausalLM, Gemma4Router
from inferd.models.gemma4_multimodal import Gemma4MultimodalForCausalLM
from inferd.models.llama import LlamaForCausalLM
from inferd.serving.sizing import kv_shape
from tests.models.test_llama_parity import full_forward
from tests.models.tiny import VOCAB
from tests.models.tiny_gemma4 import (
    MM_VOCAB,
    WINDOW,
    mm_config,
    randomize_gemma4,
    save_tiny_gemma4_text,
    text_config,
)

LOGIT_TOLERANCE = 1e-4  # float32 on both sides: only summation order differs
PROMPT = torch.randint(3, VOCAB, (23,), generator=torch.Generator().manual_seed(4)).tolist()
MOE: dict[str, Any] = dict(
    enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24
)
SHAPES: dict[str, dict[str, Any]] = {
    "full": {},
    "moe": MOE,
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


Pair = tuple[str, Any, LlamaForCausalLM]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Pair]:
    """Each shape's transformers model and ours, built once when first asked for."""
    pairs: dict[str, Pair] = {}

    def build(shape: str) -> Pair:
        if shape not in pairs:
            directory = tmp_path_factory.mktemp(f"gemma4_{shape}")
            hf = save_tiny_gemma4_text(directory, **SHAPES[shape])
            ours, _ = load_safetensors_model(directory, torch.float32, progress=False)
            pairs[shape] = (shape, hf, ours)
        return pairs[shape]

    return build


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request: pytest.FixtureRequest, built: Callable[[str], Pair]) -> Pair:
    return built(request.param)


def test_config_reads_each_layers_shape(pair: tuple[str, Any, LlamaForCausalLM]) -> None:
    shape, _, ours = pair
    cfg = ours.config
    assert isinstance(ours, Gemma4ForCausalLM) and cfg.gemma4 is not None
    assert cfg.sliding_layers == (0, 2, 4) and cfg.sliding_window == WINDOW
    assert [cfg.kv_shape(i) for i in range(2)] == [(2, 16), (2 if shape == "plain" else 1, 32)]
    if shape == "moe":
        assert cfg.moe is not None and cfg.moe.layers == tuple(range(6))
        assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (4, 2, 24)
    else:
        assert cfg.moe is None
    if shape != "plain":  # layers 4 and 5 read the last sliding and global layers before them
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


def test_top_1_routing_moves_the_logits(
    built: Callable[[str], Pair], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parity above would catch a router that picks one expert. (Whether the top-2 weights
    are renormalized cannot show in Gemma 4: it scales a token's whole expert output, which
    the experts' post-norm takes out again.)"""
    _, hf, ours = built("moe")
    for layer in ours.layers:
        monkeypatch.setattr(layer.moe.router, "top_k", 1)  # type: ignore[union-attr]
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    logits = full_forward(ours, PROMPT, block_size=4)
    assert (logits - expected).abs().max() > 100 * LOGIT_TOLERANCE


def test_router_matches_transformers_in_bf16(built: Callable[[str], Pair]) -> None:
    """The experts picked and their weights (float32, scaled per expert) bit for bit."""
    _, hf, ours = built("moe")
    theirs = hf.model.layers[0].router
    mine = ours.layers[0].moe.router  # type: ignore[union-attr]
    assert isinstance(mine, Gemma4Router)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    with torch.no_grad():
        _, ref_weights, ref_experts = copy.deepcopy(theirs).bfloat16()(x)
        weights, experts = copy.deepcopy(mine).bfloat16()(x)
    assert torch.equal(experts, ref_experts) and len(set(experts.flatten().tolist())) == 4
    assert weights.dtype == ref_weights.dtype == torch.float32
    assert torch.equal(weights, ref_weights)


def test_moe_under_the_multimodal_wrapper_matches_transformers(tmp_path: Path) -> None:
    """Gemma4ForConditionalGeneration's decoder (under ``model.language_model.``) with the
    experts: text logits equal transformers'."""
    from transformers import Gemma4ForConditionalGeneration

    torch.manual_seed(0)
    hf = Gemma4ForConditionalGeneration(mm_config(**MOE)).float()
    randomize_gemma4(hf, 3)
    hf.save_pretrained(str(tmp_path))
    hf.config._attn_implementation = "eager"
    ours, cfg = load_safetensors_model(tmp_path, torch.float32, progress=False)
    assert isinstance(ours, Gemma4MultimodalForCausalLM) and cfg.moe is not None
    prompt = [t % MM_VOCAB for t in PROMPT]
    with torch.no_grad():
        expected = hf.eval()(input_ids=torch.tensor([prompt])).logits[0]
    logits = full_forward(ours, prompt, block_size=4)
    assert (logits - expected).abs().max() < LOGIT_TOLERANCE


def test_moe_without_its_sizes_is_refused_with_a_clear_message() -> None:
    hf = text_config(enable_moe_block=True, num_experts=4, top_k_experts=2).to_dict()
    with pytest.raises(ModelConfigError, match="moe_intermediate_size"):
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
