"""Gemma 3 270M against transformers reading the same GGUF (the stored oracle written by
tests/models/gemma3_reference.py): logits on four prompts, and the perplexity of a fixed text
that runs past the 512-token sliding window, both on the bare model in float32 and through the
whole engine at its default dtype (chunked prefill into the paged KV cache)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from inferd import LLM, SamplingParams
from inferd.loading.gguf import GGUFFile
from inferd.loading.gguf_model import load_gguf_model
from inferd.models.gemma import Gemma3ForCausalLM
from inferd.models.llama import LlamaForCausalLM
from tests.models.gemma3_reference import FIXTURE, PROMPTS, perplexity
from tests.models.test_llama_parity import full_forward

LOGIT_TOLERANCE = 1e-3  # float32 on both sides: only summation order differs
PERPLEXITY_TOLERANCE = 0.01  # relative


@pytest.fixture(scope="module")
def reference(gemma3_gguf: Path) -> dict[str, Any]:
    data: dict[str, Any] = torch.load(FIXTURE)
    assert [p["prompt"] for p in data["prompts"]] == PROMPTS, "rerun gemma3_reference.py"
    return data


@pytest.fixture(scope="module")
def ours_f32(gemma3_gguf: Path) -> LlamaForCausalLM:
    return load_gguf_model(GGUFFile(gemma3_gguf), torch.float32, progress=False)[0]


def test_config_is_gemma3_270m(ours_f32: LlamaForCausalLM) -> None:
    cfg = ours_f32.config
    assert isinstance(ours_f32, Gemma3ForCausalLM)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (18, 640, 4, 1)
    assert cfg.head_dim == 256 and cfg.vocab_size == 262_144 and cfg.sliding_window == 512
    assert [i for i in range(18) if i not in cfg.sliding_layers] == [5, 11, 17]
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.attn_softcap is None and cfg.final_softcap is None and cfg.qk_norm


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_f32_logits_match_transformers(
    index: int, ours_f32: LlamaForCausalLM, reference: dict[str, Any]
) -> None:
    ref = reference["prompts"][index]
    logits = full_forward(ours_f32, ref["ids"])
    per_position = logits.gather(1, ref["topk_ids"].long())
    assert (per_position - ref["topk_logits"]).abs().max() < LOGIT_TOLERANCE
    last = logits[-1]
    last_top = last[ref["last_topk_ids"].long()]
    assert (last_top - ref["last_topk_logits"]).abs().max() < LOGIT_TOLERANCE
    # The logsumexp covers all 262,144 logits, not only the stored top ones.
    assert abs(float(torch.logsumexp(last.double(), 0)) - ref["last_logsumexp"]) < LOGIT_TOLERANCE
    assert torch.equal(logits.argmax(-1), ref["topk_ids"][:, 0].long())


def test_f32_perplexity_past_the_window_matches(
    ours_f32: LlamaForCausalLM, reference: dict[str, Any]
) -> None:
    ids = reference["perplexity_ids"]
    assert len(ids) > 512  # the sliding window hides keys for the later tokens
    ours = perplexity(full_forward(ours_f32, ids), ids)
    assert abs(ours / reference["perplexity"] - 1) < PERPLEXITY_TOLERANCE


def test_engine_default_dtype_perplexity_and_greedy_match(
    gemma3_gguf: Path, reference: dict[str, Any]
) -> None:
    """The serving path at its defaults (dtype auto): prompt logprobs give the perplexity; the
    chunked prefill (256 tokens a step) crosses the window inside the paged cache."""
    ids = reference["perplexity_ids"]
    with LLM(str(gemma3_gguf), max_num_batched_tokens=256, kv_cache_tokens=4096) as llm:
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        first = reference["prompts"][0]
        greedy = llm.generate(
            [first["ids"]], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False
        )
    logprobs = out[0].prompt_logprobs
    assert logprobs is not None and logprobs[0] is None and len(logprobs) == len(ids)
    nll = -sum(lp.logprob for lp in logprobs[1:] if lp is not None) / (len(ids) - 1)
    assert abs(math.exp(nll) / reference["perplexity"] - 1) < PERPLEXITY_TOLERANCE
    assert list(greedy[0].outputs[0].token_ids) == first["greedy"]
