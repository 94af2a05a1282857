"""--dtype f16 end to end on the real default model: weights, KV cache and the plain ops in
float16 (the fused kernels take float32 and bfloat16 only), and the sampler on its logits."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine.outputs import RequestOutput
from inferd.engine.sampling import SamplingParams
from inferd.serving.served import ServedModel, load_model
from inferd.source import resolve_source

PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]
# float16 keeps 10 mantissa bits: its logprobs stay within a few hundredths of float32's.
TOLERANCE = 0.1


@pytest.fixture(scope="module")
def served_f16(smollm2_gguf: Path) -> Iterator[ServedModel]:
    cfg = EngineConfig(dtype="f16", max_num_seqs=4, kv_cache_tokens=512)
    served = load_model(resolve_source(str(smollm2_gguf)), cfg, progress=False)
    yield served
    served.shutdown()


def _run(served: ServedModel, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    async def go() -> list[RequestOutput]:
        return [o async for o in served.engine.generate(prompt, params)]

    return asyncio.run(go())


def test_f16_runs_in_float16_on_the_plain_ops(served_f16: ServedModel) -> None:
    assert served_f16.dtype == torch.float16
    assert served_f16.engine.engine.model.lm_head.weight.dtype == torch.float16
    assert (
        "float32 and bfloat16" in served_f16.engine.engine.model.layers[0].self_attn.ops.description
    )


def test_f16_scores_the_f32_continuation_like_f32(
    served_f16: ServedModel, served_f32: ServedModel
) -> None:
    """The float32 engine's greedy reply, scored token by token by both engines."""
    prompt = served_f32.chat_prompt(PROMPT).ids
    greedy = _run(served_f32, prompt, SamplingParams(max_tokens=12, temperature=0.0))
    text = prompt + [t for o in greedy for t in o.token_ids]
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    f32 = _run(served_f32, text, scoring)[-1].prompt_logprobs
    f16 = _run(served_f16, text, scoring)[-1].prompt_logprobs
    assert f32 is not None and f16 is not None and len(f16) == len(text)
    for i in range(len(prompt), len(text)):
        a, b = f32[i], f16[i]
        assert a is not None and b is not None and b.token_id == text[i]
        assert abs(a.logprob - b.logprob) < TOLERANCE, (i, a.logprob, b.logprob)


def test_f16_samples_with_logprobs(served_f16: ServedModel) -> None:
    prompt = served_f16.chat_prompt(PROMPT).ids
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, logprobs=3)
    outputs = _run(served_f16, prompt, params)
    lps = [lp for o in outputs for lp in (o.logprobs or ())]
    assert len(lps) == sum(len(o.token_ids) for o in outputs) > 0
    assert all(math.isfinite(lp.logprob) and lp.logprob <= 0 and len(lp.top) == 3 for lp in lps)
    again = [t for o in _run(served_f16, prompt, params) for t in o.token_ids]
    assert again == [t for o in outputs for t in o.token_ids]  # a seed repeats in f16 too


def test_f16_embeddings_match_f32(minilm_dir: Path) -> None:
    from inferd.serving.loading import load_embedding_model

    source = resolve_source(str(minilm_dir))
    models = [load_embedding_model(source, dtype) for dtype in ("f16", "f32")]
    try:
        ids = models[1].tokenize(["The cat sat on the mat.", "A dog ran in the park."])
        f16, f32 = (torch.tensor(asyncio.run(m.embed_async(ids))) for m in models)
        assert models[0].dtype == torch.float16
        cosine = torch.nn.functional.cosine_similarity(f16, f32)
        assert bool((cosine > 0.999).all()), cosine
    finally:
        for m in models:
            m.shutdown()
