"""Live: a greedy stream with prompt-lookup speculation, and with a draft model (the model
itself, ``--speculative draft --draft-model``), gives the same text as without it, in fewer
chunks than tokens (a verify step's accepted tokens travel together)."""

from __future__ import annotations

from pathlib import Path

import openai

from tests.server.live import live_server

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp and wrote in "
    "his log the wind, the rain, the colour of the sea, and the names of the ships that passed "
    "the headland before the tide turned."
)
MESSAGES = [{"role": "user", "content": f"Repeat this text twice, word for word:\n\n{PASSAGE}"}]


def _stream(api: str) -> tuple[str, int, int]:
    """The streamed text, its chunks with content and its completion tokens."""
    with openai.OpenAI(base_url=api, api_key="unused", max_retries=0) as client:
        stream = client.chat.completions.create(  # type: ignore[call-overload]
            model="default",
            messages=MESSAGES,
            temperature=0,
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, tokens = [], 0
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    return "".join(parts), len(parts), tokens


def test_stream_with_speculation_matches_without(smollm2_gguf: Path, tmp_path: Path) -> None:
    results, accepted = {}, {}
    for mode in ("ngram", "draft", "off"):
        args = ["-m", str(smollm2_gguf), "--max-seqs", "2", "--speculative", mode]
        if mode == "draft":
            args += ["--draft-model", str(smollm2_gguf)]
        with live_server(args, tmp_path / f"serve-{mode}.log") as live:
            results[mode] = _stream(live.api)
            accepted[mode] = live.metric("inferd_speculative_accepted_tokens_total")
    fast, plain = results["ngram"], results["off"]
    assert fast[0] and fast[0] == plain[0]
    assert fast[2] == plain[2]
    assert fast[1] < fast[2] * 0.75  # speculation streamed several tokens per chunk
    assert plain[1] > fast[1]
    assert accepted["ngram"] > 0 and accepted["off"] == 0
    drafted = results["draft"]
    assert drafted[0] == plain[0] and drafted[2] == plain[2]
    assert drafted[1] < drafted[2] * 0.5  # the model drafting for itself: ~all accepted
    assert accepted["draft"] > 0
