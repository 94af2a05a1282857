"""Default mode, live: a greedy reply is the same streamed or not, and on a retry whose prompt the
prefix cache holds, with the prompt prefilled in chunks of 32 tokens (default dtype: bf16 where
the CPU has it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.live import LiveServer, live_server

MESSAGES = [
    {
        "role": "user",
        "content": "Ships passing along the coast counted the lighthouse's flashes to know which "
        "headland they were passing. " * 4 + "Tell the story of one such night.",
    }
]


@pytest.fixture(scope="module")
def default_server(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("serve-default") / "serve.log"
    args = ["-m", str(smollm2_gguf), "--max-seqs", "4", "--max-num-batched-tokens", "32"]
    with live_server(args, log) as live:
        yield live


def test_greedy_reply_ignores_streaming_and_prefix_hits(default_server: LiveServer) -> None:
    with openai.OpenAI(base_url=default_server.api, api_key="unused", max_retries=0) as client:

        def ask() -> tuple[str, list[float]]:
            reply = client.chat.completions.create(
                model="default",
                messages=MESSAGES,  # type: ignore[arg-type]
                temperature=0,
                max_tokens=12,
                logprobs=True,
            )
            choice = reply.choices[0]
            assert choice.logprobs is not None and choice.logprobs.content is not None
            return choice.message.content or "", [t.logprob for t in choice.logprobs.content]

        first = ask()
        hits = default_server.metric("inferd_prefix_cache_hits_total")
        stream = client.chat.completions.create(
            model="default",
            messages=MESSAGES,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=12,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        retry = ask()
        assert default_server.metric("inferd_prefix_cache_hits_total") > hits
    assert first[0] and streamed == first[0]
    assert retry == first  # text and logprobs, bit for bit
    info = httpx.get(default_server.api + "/system/info", timeout=10).json()
    assert info["server"]["models"][0]["deterministic"] is False
