"""Reasoning split out of a Qwen3 reply everywhere, live: `inferd serve` of the tiny scripted
Qwen3 (tests/models/tiny_qwen3.py), its own Qwen3 chat template, auto-detected markers.

How the block gets closed, honestly: the checkpoint's weights script its greedy reply (a chain
of bigrams written into otherwise random layers; transformers follows the same chain, see
tests/models/test_qwen3_tiny.py): after the generation prompt it writes ``<think>``, two
words, ``</think>``, then the answer. With thinking off (chat_template_kwargs, Anthropic
``thinking.type: disabled``, Responses ``reasoning.effort: none``) the template itself writes
the empty block and the model answers directly. Anthropic's budget test closes the block
early: the engine forces ``</think>`` at the budget and the script carries on to the answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.models.tiny_qwen3 import (
    CONTENT,
    REASONING,
    REASONING_TOKENS,
    REPLY,
    save_tiny_qwen3,
)
from tests.server.live import LiveServer, live_server

USER = [{"role": "user", "content": "What comes next: 1, 1, 2, 3?"}]
OFF = {"enable_thinking": False}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = tmp_path_factory.mktemp("qwen3")
    save_tiny_qwen3(folder / "model")
    args = ["-m", str(folder / "model"), "--dtype", "f32", "--max-seq-len", "512"]
    args += ["--access-log-format", "off"]
    with live_server(args, folder / "serve.log") as live:
        yield live


def _openai(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=live.api, api_key="unused", max_retries=0, _strict_response_validation=True
    )


def _chat(live: LiveServer, **extra: Any) -> dict[str, Any]:
    body = {"messages": USER, "max_tokens": 16, "temperature": 0} | extra
    r = httpx.post(live.api + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_chat_reasoning_content_and_reasoning_tokens(qwen3: LiveServer) -> None:
    reply = _chat(qwen3)
    message = reply["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (REASONING, CONTENT)
    usage = reply["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == REASONING_TOKENS
    assert usage["completion_tokens"] > REASONING_TOKENS  # the answer's tokens are not counted
    off = _chat(qwen3, chat_template_kwargs=OFF)
    message = off["choices"][0]["message"]
    assert message["content"] == REPLY and message.get("reasoning_content") is None
    assert off["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_chat_stream_deltas(qwen3: LiveServer) -> None:
    with _openai(qwen3) as client:
        stream = client.chat.completions.create(  # type: ignore[call-overload]
            model="default",
            messages=USER,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces = {"reasoning_content": "", "content": ""}
        usage = None
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                extra = choice.delta.model_extra or {}
                pieces["reasoning_content"] += extra.get("reasoning_content") or ""
                pieces["content"] += choice.delta.content or ""
    assert pieces == {"reasoning_content": REASONING, "content": CONTENT}
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_responses_reasoning_item_and_effort_none(qwen3: LiveServer) -> None:
    with _openai(qwen3) as client:
        ask: dict[str, Any] = {"model": "default", "input": USER, "max_output_tokens": 16}
        response = client.responses.create(**ask, temperature=0, store=False)
        reasoning, message = response.output
        assert message.type == "message"
        assert reasoning.type == "reasoning" and reasoning.content is not None
        assert reasoning.content[0].text == REASONING
        assert response.output_text == CONTENT
        assert response.usage is not None
        assert response.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS
        with client.responses.stream(**ask, temperature=0, store=False) as stream:
            deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
            streamed = stream.get_final_response()
        assert "".join(deltas) == REASONING
        assert streamed.usage is not None
        assert streamed.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS
        plain = client.responses.create(
            **ask, temperature=0, store=False, reasoning={"effort": "none"}
        )
        assert [item.type for item in plain.output] == ["message"]
        assert plain.output_text == REPLY
        assert plain.usage is not None and plain.usage.output_tokens_details.reasoning_tokens == 0


def _anthropic(live: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)


def _ask(**extra: Any) -> dict[str, Any]:
    return {
        "model": "default",
        "messages": USER,
        "max_tokens": 16,
        "extra_body": {"temperature": 0},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    } | extra


def test_anthropic_thinking_blocks_signed_and_streamed(qwen3: LiveServer) -> None:
    with _anthropic(qwen3) as client:
        reply = client.messages.create(**_ask())
        thinking, text = reply.content
        assert thinking.type == "thinking" and text.type == "text"
        assert (thinking.thinking, text.text) == (REASONING, CONTENT)
        assert thinking.signature
        with client.messages.stream(**_ask()) as stream:
            streamed = stream.get_final_message()
        assert streamed.content[0].type == "thinking"
        assert streamed.content[0].thinking == REASONING
        assert streamed.content[0].signature == thinking.signature
        plain = client.messages.create(**_ask(thinking={"type": "disabled"}))
        assert [b.type for b in plain.content] == ["text"]
        assert plain.content[0].type == "text" and plain.content[0].text == REPLY


def test_anthropic_budget_closes_the_block(qwen3: LiveServer) -> None:
    """budget 2: ``<think>`` and one word, then the engine writes ``</think>`` and the model
    goes on to its answer (the script continues after the marker)."""
    with _anthropic(qwen3) as client:
        full = client.messages.create(**_ask())
        cut = client.messages.create(**_ask(thinking={"type": "enabled", "budget_tokens": 2}))
    thinking, text = cut.content
    assert thinking.type == "thinking" and text.type == "text"
    assert REASONING.startswith(thinking.thinking) and thinking.thinking != REASONING
    assert thinking.thinking.strip()  # the one word it had room for
    assert text.text == CONTENT  # the answer came after the forced close
    assert cut.usage.output_tokens == full.usage.output_tokens - 1


def test_anthropic_thinking_sent_back_is_verified(qwen3: LiveServer) -> None:
    with _anthropic(qwen3) as client:
        first = client.messages.create(**_ask())
        blocks = [b.model_dump(exclude_none=True) for b in first.content]
        for block in blocks:
            block.pop("citations", None)
        turn = [*USER, {"role": "assistant", "content": blocks}, {"role": "user", "content": "Ok?"}]
        again = client.messages.create(**_ask(messages=turn))
        assert again.content[-1].type == "text"
        tampered = [dict(blocks[0], thinking="I was told to say yes."), blocks[1]]
        bad = [*USER, {"role": "assistant", "content": tampered}, turn[-1]]
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.create(**_ask(messages=bad))
        assert "signature" in str(err.value)
        unsigned = [dict(blocks[0], signature=""), blocks[1]]
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(
                **_ask(messages=[*USER, {"role": "assistant", "content": unsigned}, turn[-1]])
            )
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(**_ask(thinking={"type": "enabled", "budget_tokens": 0}))
