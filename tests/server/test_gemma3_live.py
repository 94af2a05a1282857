"""Gemma 3 270M (a base model, no chat template) behind a real `inferd serve` on loopback:
greedy /v1/completions agrees with transformers' greedy continuation (the stored oracle),
chat without a template is a 400 naming ``--chat-template FILE``, and with the flag chat works.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from inferd.bench.http import run_http
from inferd.bench.workloads import Workload
from tests.models.gemma3_reference import FIXTURE
from tests.server.live import LiveServer, live_server

# A Gemma-style turn format, written here: the base model never saw it, but it renders.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Name a color."}]
SERVE_ARGS = ["--dtype", "f32", "--max-seqs", "4", "--max-seq-len", "1024"]


@pytest.fixture(scope="module")
def base_server(
    gemma3_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("gemma3") / "serve.log"
    with live_server(["-m", "gemma3", *SERVE_ARGS], log) as live:
        yield live


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    data: dict[str, Any] = torch.load(FIXTURE)
    return data


def test_greedy_completion_matches_transformers(
    base_server: LiveServer, reference: dict[str, Any]
) -> None:
    for ref in reference["prompts"][:2]:
        body = {"model": "gemma3", "prompt": ref["prompt"], "max_tokens": 8, "temperature": 0}
        r = httpx.post(base_server.api + "/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == ref["greedy_text"]
        assert r.json()["usage"]["prompt_tokens"] == len(ref["ids"])


def test_chat_without_a_template_is_a_clear_400(base_server: LiveServer) -> None:
    body = {"model": "gemma3", "messages": MESSAGES, "max_tokens": 4}
    r = httpx.post(base_server.api + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "--chat-template FILE" in error["message"] and "no chat template" in error["message"]
    assert error["param"] == "messages"
    # The Anthropic route renders through the same template and refuses the same way.
    anthropic = {"model": "gemma3", "messages": MESSAGES, "max_tokens": 4}
    r = httpx.post(base_server.api + "/messages", json=anthropic, timeout=60)
    assert r.status_code == 400 and "--chat-template FILE" in r.text
    assert httpx.get(base_server.url + "/health", timeout=10).status_code == 200


def test_chat_works_with_a_template_file(
    gemma3_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tmp_path_factory.mktemp("gemma3-chat")
    template = folder / "turns.jinja"
    template.write_text(TEMPLATE)
    args = ["-m", "gemma3", "--chat-template", str(template), *SERVE_ARGS]
    with live_server(args, folder / "serve.log") as live:
        body = {"model": "gemma3", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
        r = httpx.post(live.api + "/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["completion_tokens"] >= 1
        # The prompt is the template's rendering: BOS, the turn markers, the message.
        counted = httpx.post(live.url + "/tokenize", json={"messages": MESSAGES}, timeout=30)
        ids = counted.json()["tokens"]
        rendered = "<start_of_turn>user\nName a color.<end_of_turn>\n<start_of_turn>model\n"
        plain = httpx.post(live.url + "/tokenize", json={"prompt": rendered}, timeout=30)
        assert ids == plain.json()["tokens"] and out["usage"]["prompt_tokens"] == len(ids)
        assert ids.count(2) == 1  # the template's BOS text, and no second one added


def test_bench_drives_a_base_model_with_plain_prompts(base_server: LiveServer) -> None:
    """`inferd bench` on gemma3 sends text workloads to /v1/completions (chat would be a 400)."""
    workload = Workload("two text streams", requests=2, concurrency=2, max_tokens=4, text=True)
    summary = asyncio.run(run_http(base_server.api, "default", workload))
    assert summary.incomplete == 0 and summary.tokens_per_second > 0
    chat = Workload("chat", requests=1, concurrency=1, max_tokens=4)
    assert asyncio.run(run_http(base_server.api, "default", chat)).incomplete == 1
