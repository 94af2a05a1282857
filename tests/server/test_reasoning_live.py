"""Reasoning split from the answer, live: SmolLM2 behind `inferd serve` with a synthetic template
whose generation prompt opens ``<think>`` (so auto-detection splits). Earlier assistant turns
reason in ``<think>..</think>`` then answer; the 135M model copies that shape greedily, so its
reply closes the block and goes on. The raw reply, from /v1/completions on the same prompt ids
(never split), must equal reasoning + content with the markers removed; streamed deltas join to
the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.server.live import LiveServer, live_server

TEMPLATE = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is not defined or enable_thinking %}<think>
{% endif %}{% endif %}"""

# Earlier turns that reasoned then answered: the model copies their shape greedily.
TURN = [
    {"role": "user", "content": "Color?"},
    {"role": "assistant", "content": "<think>\nsky\n</think>\nblue"},
]
MESSAGES = [*TURN * 4, {"role": "user", "content": "Color?"}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def thinker(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = tmp_path_factory.mktemp("reasoning")
    (folder / "think.jinja").write_text(TEMPLATE)
    args = ["-m", str(smollm2_gguf), "--dtype", "f32", "--max-seq-len", "1024"]
    args += ["--chat-template", str(folder / "think.jinja")]
    with live_server(args, folder / "serve.log") as live:
        yield live


@pytest.fixture(scope="module")
def raw(thinker: LiveServer) -> str:
    """The greedy reply to the chat prompt, unsplit (completions never split)."""
    ids = httpx.post(thinker.url + "/tokenize", json={"messages": MESSAGES}, timeout=30)
    body = {"prompt": ids.json()["tokens"], "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(thinker.api + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    text: str = r.json()["choices"][0]["text"]
    assert "</think>" in text  # the model copied the pattern: the split has both sides
    return text


def _client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=live.api, api_key="unused", max_retries=0, _strict_response_validation=True
    )


def test_chat_reasoning_content_and_stream(thinker: LiveServer, raw: str) -> None:
    with _client(thinker) as client:
        ask = {"model": "default", "messages": MESSAGES, "max_tokens": MAX_TOKENS}
        reply = client.chat.completions.create(**ask, temperature=0)  # type: ignore[call-overload]
        message = reply.choices[0].message
        reasoning = message.model_extra["reasoning_content"]
        assert reasoning == raw[: raw.index("</think>")]  # started in reasoning (the prompt)
        assert reasoning + message.content == raw.replace("</think>", "", 1)
        stream = client.chat.completions.create(**ask, temperature=0, stream=True)  # type: ignore[call-overload]
        pieces = {"reasoning_content": "", "content": ""}
        order = []
        for chunk in stream:
            for choice in chunk.choices:
                for key in pieces:
                    piece = (choice.delta.model_extra or {}).get(key) or getattr(
                        choice.delta, key, None
                    )
                    if piece:
                        pieces[key] += piece
                        order.append(key)
        assert pieces == {"reasoning_content": reasoning, "content": message.content}
        assert order[0] == "reasoning_content" and order[-1] == "content"


def test_responses_reasoning_item_then_message(thinker: LiveServer, raw: str) -> None:
    with _client(thinker) as client:
        ask = {"model": "default", "input": MESSAGES, "max_output_tokens": MAX_TOKENS}
        response = client.responses.create(**ask, temperature=0, store=False)  # type: ignore[call-overload]
        reasoning, message = response.output
        assert reasoning.type == "reasoning" and message.type == "message"
        assert reasoning.content is not None
        thought = reasoning.content[0].text
        assert thought + response.output_text == raw.replace("</think>", "", 1)
        assert thought == raw[: raw.index("</think>")]
        with client.responses.stream(**ask, temperature=0, store=False) as stream:  # type: ignore[call-overload]
            deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
            streamed = stream.get_final_response()
        assert "".join(deltas) == thought
        assert [item.type for item in streamed.output] == ["reasoning", "message"]
        assert streamed.output_text == response.output_text


def test_anthropic_thinking_block_then_text(thinker: LiveServer, raw: str) -> None:
    with anthropic.Anthropic(base_url=thinker.url, api_key="unused", max_retries=0) as client:
        ask: dict[str, Any] = {
            "model": "default",
            "messages": MESSAGES,
            "max_tokens": MAX_TOKENS,
            "extra_body": {"temperature": 0},  # this SDK version dropped the kwarg
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        }
        reply = client.messages.create(**ask)
        assert [block.type for block in reply.content] == ["thinking", "text"]
        thinking, text = reply.content
        assert thinking.type == "thinking" and text.type == "text"
        assert thinking.thinking + text.text == raw.replace("</think>", "", 1)
        assert thinking.thinking == raw[: raw.index("</think>")]
        with client.messages.stream(**ask) as stream:
            streamed = stream.get_final_message()

        def shape(content: Any) -> list[tuple[str, str]]:
            return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in content]

        assert shape(streamed.content) == shape(reply.content)
        # thinking disabled: the template hears enable_thinking=false (its prompt opens no
        # block, so it is shorter), and no thinking block comes back
        plain = client.messages.create(**(ask | {"thinking": {"type": "disabled"}}))
        assert [b.type for b in plain.content] == ["text"]
        assert plain.usage.input_tokens < reply.usage.input_tokens


def test_chat_template_kwargs_reach_the_template(thinker: LiveServer) -> None:
    def ask(extra: dict[str, Any]) -> httpx.Response:
        body = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0} | extra
        return httpx.post(thinker.api + "/chat/completions", json=body, timeout=120)

    thinking = ask({}).json()
    off = ask({"chat_template_kwargs": {"enable_thinking": False}})
    assert off.status_code == 200, off.text
    # the template left out its "<think>\n": the prompt is shorter, and the reply no longer
    # starts inside the block
    assert off.json()["usage"]["prompt_tokens"] < thinking["usage"]["prompt_tokens"]
    message = off.json()["choices"][0]["message"]
    assert message != thinking["choices"][0]["message"]
    bads: list[dict[str, Any]] = [{"messages": []}, {"enable_thinking": {"deep": True}}]
    for bad in bads:
        r = ask({"chat_template_kwargs": bad})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "chat_template_kwargs"
