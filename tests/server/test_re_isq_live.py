"""POST /re_isq on a real `inferd serve` (SmolLM2, Q4_1 GGUF), against a second one started
with `--isq q8` on the same file: the oracle for what the re-quantized model answers.

The module's fixtures run one story on the first server, in order: refusals (each changes
nothing), the answers and prefix-cache hits before, a streamed request in flight while
/re_isq q8 runs, then everything the server says and answers after; the tests check what they
recorded. The last test re-quantizes both servers again with mistral.rs's bodies.

The stream in flight holds the swap for as long as the test keeps it open, whatever the speed
of the machine: it may run to a ceiling of tokens it never reaches, and the test closes it
(the server aborts it) once the server shows status ``requantizing`` (the new weights made,
the drain waiting on it) and a request sent meanwhile waits. A few dozen tokens are read, not
hundreds: only what the engine makes while the new weights are prepared.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.live import LiveServer, live_server

ADMIN_KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPTS = ("Name three colors.", "What is the capital of France?", "Count from one to five.")
# A prompt of many KV blocks, alone in the prefix cache (a raw completion: no chat template
# whose system prompt other requests share).
LONG = " ".join(
    f"Line {i}: the lighthouse keeper wrote down the wind and the sea." for i in range(12)
)
# The stream's reference on the old weights, read before the swap; the stream may run to the
# ceiling (with --max-seq-len 1024) but is closed by the test long before it.
REFERENCE_TOKENS = 32
STREAM_CEILING = 900
# Tokens the stream goes on streaming once the swap waits on it, before the test looks whether
# the swap and the request sent meanwhile still wait (a server that did not wait has answered).
HELD_TOKENS = 8


@dataclass(frozen=True)
class Servers:
    plain: LiveServer  # re-quantized by the tests
    isq_q8: LiveServer  # `--isq q8` from the start
    model: str


@pytest.fixture(scope="module")
def servers(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    tmp = tmp_path_factory.mktemp("re_isq")
    common = ["-m", str(smollm2_gguf), "--max-seqs", "4", "--max-seq-len", "1024"]
    with (
        live_server([*common, "--admin-key", ADMIN_KEY], tmp / "plain.log") as plain,
        live_server([*common, "--isq", "q8"], tmp / "isq_q8.log") as isq_q8,
    ):
        model = httpx.get(f"{plain.api}/models", timeout=30).json()["data"][0]["id"]
        yield Servers(plain, isq_q8, model)


def _client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=live.api, api_key="unused", max_retries=0, _strict_response_validation=True
    )


def _answer(live: LiveServer, prompt: str, max_tokens: int = 24, ignore_eos: bool = False) -> str:
    with _client(live) as client:
        reply = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": ignore_eos},
        )
    return reply.choices[0].message.content or ""


def _complete_long(live: LiveServer) -> str:
    with _client(live) as client:
        return (
            client.completions.create(model="default", prompt=LONG, max_tokens=8, temperature=0)
            .choices[0]
            .text
        )


def _card(live: LiveServer, model: str) -> dict[str, Any]:
    return dict(httpx.get(f"{live.api}/models/{model}", timeout=30).json())


def _metric(live: LiveServer, pattern: str) -> float:
    text = httpx.get(f"{live.url}/metrics", timeout=30).text
    found = re.search(rf"^{pattern} (\S+)$", text, re.MULTILINE)
    assert found is not None, pattern
    return float(found.group(1))


def _prefix_hits(live: LiveServer, model: str) -> float:
    return _metric(live, rf'inferd_prefix_cache_hits_total\{{model="{re.escape(model)}"\}}')


def _weight_isq(live: LiveServer, model: str) -> str:
    text = httpx.get(f"{live.url}/metrics", timeout=30).text
    found = re.search(
        rf'^inferd_model_weight_bytes\{{isq="(\w+)",model="{re.escape(model)}"\}}',
        text,
        re.MULTILINE,
    )
    assert found is not None
    return found.group(1)


def _re_isq(live: LiveServer, body: Any, **kwargs: Any) -> httpx.Response:
    kwargs.setdefault("headers", ADMIN)
    return httpx.post(f"{live.url}/re_isq", json=body, timeout=600, **kwargs)


def _long_hits(live: LiveServer, model: str) -> tuple[str, float]:
    """The long completion's text, and the prompt tokens it found in the prefix cache."""
    before = _prefix_hits(live, model)
    text = _complete_long(live)
    return text, _prefix_hits(live, model) - before


# -- the story ---------------------------------------------------------------------------------
@dataclass
class Refusal:
    status: int
    error: dict[str, Any]


@pytest.fixture(scope="module")
def refusals(servers: Servers) -> dict[str, Refusal]:
    live, model = servers.plain, servers.model
    answer = _answer(live, PROMPTS[0])
    cases: dict[str, tuple[Any, dict[str, Any]]] = {
        "no key": ({"isq": "q8"}, {"headers": {}}),
        "wrong key": ({"isq": "q8"}, {"headers": {"Authorization": "Bearer nope"}}),
        "unknown isq": ({"isq": "q5"}, {}),
        "unserved ggml_type": ({"ggml_type": "Q6K"}, {}),
        "both": ({"isq": "q8", "ggml_type": "Q8_0"}, {}),
        "neither": ({"model": model}, {}),
        "not a string": ({"isq": 8}, {}),
        "negative drain": ({"isq": "q8", "drain_timeout": -1}, {}),
        "unknown model": ({"model": "no-such-model", "isq": "q8"}, {}),
        "not an object": (["q8"], {}),
    }
    out = {name: _refused(_re_isq(live, body, **kw)) for name, (body, kw) in cases.items()}
    plain_text = httpx.post(
        f"{live.url}/re_isq",
        content=b'{"isq": "q8"}',
        headers=ADMIN | {"content-type": "text/plain"},
        timeout=30,
    )
    out["text/plain"] = _refused(plain_text)
    assert _card(live, model).get("quantization") is None
    assert _weight_isq(live, model) == "none"
    assert _answer(live, PROMPTS[0]) == answer  # the same weights answer
    return out


def _refused(resp: httpx.Response) -> Refusal:
    body = resp.json()
    assert set(body) == {"error"}
    return Refusal(resp.status_code, body["error"])


@dataclass
class Before:
    answers: list[str]
    stream_reference: str
    long_hits: tuple[float, float]  # prompt tokens the long completion found, twice


@pytest.fixture(scope="module")
def before(servers: Servers, refusals: dict[str, Refusal]) -> Before:
    live, model = servers.plain, servers.model
    answers = [_answer(live, p) for p in PROMPTS]
    reference = _answer(live, PROMPTS[2], REFERENCE_TOKENS, ignore_eos=True)
    first, second = _long_hits(live, model)[1], _long_hits(live, model)[1]
    return Before(answers, reference, (first, second))


@dataclass
class Swap:
    """What the stream in flight and a request sent during the drain saw of /re_isq q8."""

    response: dict[str, Any]
    streamed: str
    finish_reason: str | None  # None: the server never ended the stream (the test closed it)
    held: bool  # the swap and the waiting request unanswered while the stream went on
    waited: str  # the answer to the request sent while the model was requantizing


@dataclass
class After:
    swap: Swap
    long: list[tuple[str, float]]  # the long completion twice, and its prefix-cache hits
    card: dict[str, Any]
    info_isq: str | None
    weight_isq: str
    again: dict[str, Any]  # /re_isq q8 once more
    answers: list[str]
    log: str
    oracle_answers: list[str] = field(default_factory=list)
    oracle_long: str = ""


class HeldStream:
    """A greedy chat stream read on a thread of its own, closed when asked."""

    def __init__(self, live: LiveServer) -> None:
        self.live = live
        self.pieces: list[str] = []
        self.finish: list[str] = []
        self.opened = threading.Event()
        self._close = threading.Event()
        self._reader = threading.Thread(target=self._read)
        self._reader.start()

    def _read(self) -> None:
        with _client(self.live) as client:
            chunks = client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": PROMPTS[2]}],
                max_tokens=STREAM_CEILING,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            with chunks:  # leaving it closes the connection: the server aborts the request
                for chunk in chunks:
                    for choice in chunk.choices:
                        self.pieces.append(choice.delta.content or "")
                        if choice.finish_reason is not None:
                            self.finish.append(choice.finish_reason)
                    self.opened.set()
                    if self._close.is_set():
                        return

    @property
    def running(self) -> bool:
        return self._reader.is_alive() and not self.finish

    def wait_until(self, condition: Callable[[], bool], what: str) -> None:
        """Until ``condition`` holds, the stream going on meanwhile (else the swap could not
        have waited on it: a ceiling too low for this machine, or a server that ended it)."""
        while not condition():
            assert self.running, f"the stream ended before {what}"
            time.sleep(0.05)

    def close(self) -> None:
        self._close.set()
        self._reader.join()


def _swap_held_by_a_stream(live: LiveServer, model: str) -> Swap:
    stream = HeldStream(live)
    assert stream.opened.wait(300)  # in flight: its first tokens are out
    with ThreadPoolExecutor(2) as pool:
        try:
            swap = pool.submit(_re_isq, live, {"model": model, "isq": "q8"})
            stream.wait_until(
                lambda: swap.done() or _card(live, model)["status"] == "requantizing",
                "the new weights were made",
            )
            waiting = pool.submit(_answer, live, PROMPTS[0])
            streamed = len(stream.pieces)
            stream.wait_until(
                lambda: len(stream.pieces) >= max(streamed, REFERENCE_TOKENS) + HELD_TOKENS,
                f"{HELD_TOKENS} more tokens came",
            )
            held = not swap.done() and not waiting.done()
        finally:
            stream.close()  # (a failure too: the swap and the pool wait for it)
        resp = swap.result()
        assert resp.status_code == 200, resp.text
        return Swap(
            response=resp.json(),
            streamed="".join(stream.pieces),
            finish_reason=stream.finish[-1] if stream.finish else None,
            held=held,
            waited=waiting.result(),
        )


@pytest.fixture(scope="module")
def after(servers: Servers, before: Before) -> After:
    live, model = servers.plain, servers.model
    swap = _swap_held_by_a_stream(live, model)
    long = [_long_hits(live, model), _long_hits(live, model)]  # first prompt after the swap
    info = httpx.get(f"{live.api}/system/info", timeout=30).json()
    (info_model,) = [m for m in info["server"]["models"] if m["id"] == model]
    return After(
        swap=swap,
        long=long,
        card=_card(live, model),
        info_isq=info_model.get("isq"),
        weight_isq=_weight_isq(live, model),
        again=_re_isq(live, {"isq": "q8"}).json(),
        answers=[_answer(live, p) for p in PROMPTS],
        log=live.log.read_text(),
        oracle_answers=[_answer(servers.isq_q8, p) for p in PROMPTS],
        oracle_long=_complete_long(servers.isq_q8),
    )


# -- the tests -----------------------------------------------------------------------------------
def test_refusals_answer_4xx_and_change_nothing(refusals: dict[str, Refusal]) -> None:
    status = {name: r.status for name, r in refusals.items()}
    assert status == {
        "no key": 401,
        "wrong key": 401,
        "unknown isq": 400,
        "unserved ggml_type": 400,
        "both": 400,
        "neither": 400,
        "not a string": 400,
        "negative drain": 400,
        "unknown model": 404,
        "not an object": 400,
        "text/plain": 415,
    }
    for name in ("unknown isq", "unserved ggml_type"):
        error = refusals[name].error
        assert error["code"] == "invalid_isq" and error["param"] == name.split()[1]
        assert "q8 or q4" in error["message"] and "Q4K" in error["message"]
    assert refusals["unknown model"].error["code"] == "model_not_found"
    assert refusals["no key"].error["type"] == "authentication_error"


def test_the_model_card_names_no_quantization_before_and_q8_after(
    servers: Servers, refusals: dict[str, Refusal], after: After
) -> None:
    assert _card(servers.isq_q8, servers.model)["quantization"] == "q8"
    assert after.card["quantization"] == "q8" and after.card["status"] == "loaded"
    assert after.info_isq == "q8" and after.weight_isq == "q8"
    response = after.swap.response
    assert (response["quantization"], response["previous"], response["changed"]) == (
        "q8",
        None,
        True,
    )
    assert response["model_id"] == servers.model and response["drained"] == 1
    assert after.again["changed"] is False and after.again["quantization"] == "q8"
    assert f"{servers.model} re-quantized (isq none -> q8)" in after.log


def test_a_request_in_flight_holds_the_swap_and_runs_uncut_on_the_old_weights(
    before: Before, after: After
) -> None:
    swap = after.swap
    assert swap.held  # neither the swap nor the request sent meanwhile went past it
    assert swap.finish_reason is None  # the server never ended it
    assert swap.streamed.startswith(before.stream_reference)


def test_a_request_sent_during_the_drain_waits_for_the_new_weights(after: After) -> None:
    assert after.swap.waited == after.oracle_answers[0]


def test_answers_after_q8_are_those_of_a_server_started_with_isq_q8(after: After) -> None:
    assert after.answers == after.oracle_answers
    assert all(after.answers)


def test_the_prefix_cache_serves_nothing_computed_with_the_old_weights(
    before: Before, after: After
) -> None:
    assert before.long_hits[1] > 0  # the cache works: the second time found the prompt
    (first, first_hits), (second, second_hits) = after.long
    assert first_hits == 0  # nothing from before the swap
    assert second_hits > 0  # what the new weights computed is cached again
    assert first == second == after.oracle_long


def test_mistralrs_bodies_requantize_the_default_model(servers: Servers, after: After) -> None:
    """mistral.rs's {"ggml_type"}: Q4K on the re-quantized server, its shorthand "4" on the one
    started with --isq q8. Both quantize the file's weights again, so they answer alike."""
    plain = _re_isq(servers.plain, {"ggml_type": "Q4K"})
    started_q8 = _re_isq(servers.isq_q8, {"ggml_type": "4"}, headers={})  # no admin key there
    for resp, ggml_type in ((plain, "Q4K"), (started_q8, "4")):
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert (body["ggml_type"], body["quantization"], body["previous"]) == (
            ggml_type,
            "q4",
            "q8",
        )
    assert [_answer(servers.plain, p) for p in PROMPTS] == [
        _answer(servers.isq_q8, p) for p in PROMPTS
    ]
