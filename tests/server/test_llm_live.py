"""``inferd.LLM`` on the real model, against a live `inferd serve` of the same file in f32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from inferd import LLM, SamplingParams
from tests.server.live import LiveServer

PROMPTS = ["The three primary colors are", "Once upon a time, in a small town,", "2 + 2 ="]
MESSAGES = [{"role": "user", "content": "Name a fruit that is yellow."}]


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> Iterator[LLM]:
    # The live server's settings: f32, so greedy text does not depend on the batch.
    with LLM(smollm2_gguf, dtype="f32", max_num_seqs=8, max_model_len=2048) as model:
        yield model


def _served_completion(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> str:
    full = client.completions.create(
        model=model, prompt=prompt, temperature=0, max_tokens=max_tokens
    )
    return full.choices[0].text


def test_greedy_generate_equals_the_server_in_input_order(
    llm: LLM, client: openai.OpenAI, model: str
) -> None:
    # Different lengths, so the requests finish out of input order inside the batch.
    lengths = [20, 3, 11]
    params = [SamplingParams(max_tokens=n, temperature=0) for n in lengths]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    for out, prompt, n in zip(outputs, PROMPTS, lengths, strict=True):
        (completion,) = out.outputs
        assert completion.text == _served_completion(client, model, prompt, n)
        assert completion.finish_reason == "length" and len(completion.token_ids) == n
        assert out.usage.prompt_tokens == len(out.prompt_token_ids)
        assert out.usage.completion_tokens == n
    assert llm.engine.stats().kv_blocks_used == 0 and not llm.engine.has_unfinished()


def test_chat_applies_the_template_and_equals_the_server(
    llm: LLM, client: openai.OpenAI, model: str, server: LiveServer
) -> None:
    (out,) = llm.chat(MESSAGES, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    served = client.chat.completions.create(
        model=model,
        messages=MESSAGES,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=24,
    )
    assert out.outputs[0].text == served.choices[0].message.content
    tokens = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert out.prompt_token_ids == tokens
    assert "<|im_start|>assistant" in out.prompt  # the template's turn markers, rendered


def test_a_failed_batch_check_runs_nothing(llm: LLM) -> None:
    before = llm.engine.stats().steps
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=5000)])
    assert llm.engine.stats().steps == before and not llm.engine.has_unfinished()
