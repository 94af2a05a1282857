"""The calibration routes on a real `inferd serve` (SmolLM2, Q4_1 GGUF, float32), one server:
refusals first (each changes nothing; a second start while one runs is refused in-process,
where the test holds the chunks: tests/test_calibration.py), then /calibration/start on a
text, /calibration/status until done, the matrix downloaded and saved in the store,
/calibration/apply q8, and what the server says and answers afterwards; the tests check what
the module's fixtures recorded.

The oracles run in this process on the same file: ``compute_imatrix`` of the same chunks (the
matrix the server made), and ``inferd.LLM(isq="q8", imatrix=<the downloaded file>)`` (what
``serve --isq q8 --imatrix FILE`` loads: the server's greedy answers after apply are its
answers, so the weights it serves are the ones the CLI path makes). q8, not q4: SmolLM2's
projections are Q4_1 already, which q4 restores exactly with or without a matrix
(tests/test_imatrix_cli.py says more).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from inferd import LLM, SamplingParams
from inferd.loading.calibration import compute_imatrix
from inferd.loading.imatrix_file import read_imatrix
from inferd.server.calibration_api import MAX_CALIBRATION_CHARS
from tests.server.live import LiveServer, live_server

ADMIN_KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# The haiku's greedy answer is one the matrix changes (plain q8 answers it otherwise).
PROMPTS = ("Name three colors.", "Write a haiku about the sea.", "Count from one to five.")
MAX_TOKENS = 24
TEXT = Path(argparse.__file__).read_text(encoding="utf-8")  # English prose and code
START = {"text": TEXT, "chunk_size": 128, "chunks": 3, "dataset": "argparse.py"}
STORE_NAME = "smollm2-argparse"
# How long the three chunks may take on a slow, shared machine (a deadline, not a measurement).
CALIBRATION_DEADLINE = 600


@dataclass(frozen=True)
class Server:
    live: LiveServer
    model: str
    home: Path  # its INFERD_HOME: the store save_imatrix writes into


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("calibration")
    args = ["-m", str(smollm2_gguf), "--dtype", "f32", "--max-seq-len", "1024"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("INFERD_HOME", str(tmp / "home"))  # the server's store (and the oracles')
        with live_server([*args, "--admin-key", ADMIN_KEY], tmp / "serve.log") as live:
            model = httpx.get(f"{live.api}/models", timeout=30).json()["data"][0]["id"]
            yield Server(live, model, tmp / "home")


def _post(server: Server, route: str, body: Any, **kwargs: Any) -> httpx.Response:
    kwargs.setdefault("headers", ADMIN)
    return httpx.post(f"{server.live.url}{route}", json=body, timeout=600, **kwargs)


def _get(server: Server, route: str, **kwargs: Any) -> httpx.Response:
    kwargs.setdefault("headers", ADMIN)
    return httpx.get(f"{server.live.url}{route}", timeout=60, **kwargs)


def _status(server: Server) -> dict[str, Any]:
    resp = _get(server, "/calibration/status")
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _card(server: Server) -> dict[str, Any]:
    return dict(httpx.get(f"{server.live.api}/models/{server.model}", timeout=30).json())


def _answers(server: Server) -> list[str]:
    client = openai.OpenAI(
        base_url=server.live.api, api_key="unused", max_retries=0, _strict_response_validation=True
    )
    with client:
        replies = [
            client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            for prompt in PROMPTS
        ]
    return [reply.choices[0].message.content or "" for reply in replies]


# -- the story ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Refusal:
    status: int
    error: dict[str, Any]


def _refused(resp: httpx.Response) -> Refusal:
    body = resp.json()
    assert set(body) == {"error"}, body
    return Refusal(resp.status_code, body["error"])


@pytest.fixture(scope="module")
def refusals(server: Server) -> dict[str, Refusal]:
    answers = _answers(server)
    starts: dict[str, tuple[Any, dict[str, Any]]] = {
        "no key": (START, {"headers": {}}),
        "wrong key": (START, {"headers": {"Authorization": "Bearer nope"}}),
        "unknown model": (START | {"model": "no-such-model"}, {}),
        "no text (mistral.rs's start)": ({}, {}),
        "empty text": (START | {"text": ""}, {}),
        "oversized text": (START | {"text": "a" * (MAX_CALIBRATION_CHARS + 1)}, {}),
        "shorter than a chunk": (START | {"text": "Hello there."}, {}),
        "chunk past the context": (START | {"chunk_size": 4096}, {}),
        "chunk of no tokens": (START | {"chunk_size": 0}, {}),
        "text not a string": (START | {"text": ["a"]}, {}),
    }
    out = {
        name: _refused(_post(server, "/calibration/start", b, **kw))
        for name, (b, kw) in starts.items()
    }
    out["apply before start"] = _refused(_post(server, "/calibration/apply", {"isq": "q8"}))
    out["download before start"] = _refused(_get(server, "/calibration/imatrix"))
    out["status without key"] = _refused(_get(server, "/calibration/status", headers={}))
    out["status of an unknown model"] = _refused(
        _get(server, "/calibration/status", params={"model": "no-such-model"})
    )
    assert _status(server)["state"] == "idle"
    card = _card(server)
    assert "quantization" not in card and "imatrix" not in card
    assert _answers(server) == answers  # the same weights answer
    return out


@dataclass(frozen=True)
class Calibrated:
    started: dict[str, Any]  # /calibration/start's answer
    polled: list[dict[str, Any]]  # every status read until it was done
    matrix_file: Path  # GET /calibration/imatrix, as downloaded
    applied: dict[str, Any]
    card: dict[str, Any]
    answers: list[str]
    again: dict[str, Any]  # mistral.rs's bodiless apply: the model's own method, the same matrix
    again_q8_0: dict[str, Any]  # mistral.rs's ggml_type


@pytest.fixture(scope="module")
def calibrated(
    server: Server, refusals: dict[str, Refusal], tmp_path_factory: pytest.TempPathFactory
) -> Calibrated:
    resp = _post(server, "/calibration/start", START)
    assert resp.status_code == 200, resp.text
    polled = [_status(server)]
    deadline = time.monotonic() + CALIBRATION_DEADLINE
    while polled[-1]["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.2)
        polled.append(_status(server))
    download = _get(server, "/calibration/imatrix")
    assert download.status_code == 200, download.text
    matrix_file = tmp_path_factory.mktemp("downloaded") / "smollm2.imatrix.gguf"
    matrix_file.write_bytes(download.content)
    applied = _post(server, "/calibration/apply", {"isq": "q8", "save_imatrix": STORE_NAME})
    assert applied.status_code == 200, applied.text
    return Calibrated(
        started=resp.json(),
        polled=polled,
        matrix_file=matrix_file,
        applied=applied.json(),
        card=_card(server),
        answers=_answers(server),
        again=_post(server, "/calibration/apply", {}).json(),
        again_q8_0=_post(server, "/calibration/apply", {"ggml_type": "Q8_0"}).json(),
    )


@dataclass(frozen=True)
class Oracle:
    digest: str  # compute_imatrix of the same chunks, in this process
    answers: list[str]  # LLM(isq="q8", imatrix=the downloaded file)
    plain_q8_answers: list[str]  # LLM(isq="q8"): the matrix matters, else the test proves little


@pytest.fixture(scope="module")
def oracle(smollm2_gguf: Path, calibrated: Calibrated) -> Oracle:
    options = {"dtype": "f32", "max_model_len": 1024}
    with LLM(smollm2_gguf, **options) as plain:
        imatrix = compute_imatrix(
            plain.engine.model,
            plain.model.tokenizer,
            START["text"],
            chunk_size=START["chunk_size"],
            max_chunks=START["chunks"],
            dataset=START["dataset"],
            progress=False,
        )
    with LLM(smollm2_gguf, isq="q8", imatrix=str(calibrated.matrix_file), **options) as weighted:
        answers = _greedy(weighted)
    with LLM(smollm2_gguf, isq="q8", **options) as plain_q8:
        plain_answers = _greedy(plain_q8)
    return Oracle(imatrix.digest(), answers, plain_answers)


def _greedy(llm: LLM) -> list[str]:
    """Each prompt's greedy answer, one conversation at a time, as the server was asked."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return [
        llm.chat([{"role": "user", "content": p}], greedy, use_tqdm=False)[0].outputs[0].text
        for p in PROMPTS
    ]


# -- the tests -----------------------------------------------------------------------------------
def test_refusals_answer_4xx_and_change_nothing(refusals: dict[str, Refusal]) -> None:
    status = {name: r.status for name, r in refusals.items()}
    assert status == {
        "no key": 401,
        "wrong key": 401,
        "unknown model": 404,
        "no text (mistral.rs's start)": 400,
        "empty text": 400,
        "oversized text": 400,
        "shorter than a chunk": 400,
        "chunk past the context": 400,
        "chunk of no tokens": 400,
        "text not a string": 400,
        "apply before start": 409,
        "download before start": 409,
        "status without key": 401,
        "status of an unknown model": 404,
    }
    assert "live traffic" in refusals["no text (mistral.rs's start)"].error["message"]
    assert refusals["oversized text"].error["param"] == "text"
    assert "fewer than one chunk" in refusals["shorter than a chunk"].error["message"]
    assert "context (1024)" in refusals["chunk past the context"].error["message"]
    for name in ("apply before start", "download before start"):
        assert refusals[name].error["code"] == "calibration_not_done"
    assert refusals["unknown model"].error["code"] == "model_not_found"
    assert refusals["no key"].error["type"] == "authentication_error"


def test_start_answers_at_once_and_status_follows_it_to_done(
    server: Server, calibrated: Calibrated
) -> None:
    started = calibrated.started
    assert (started["object"], started["model_id"], started["state"]) == (
        "calibration",
        server.model,
        "running",
    )
    assert (started["chunks_total"], started["chunk_size"], started["collecting"]) == (3, 128, True)
    done = calibrated.polled[-1]
    assert done["state"] == "done" and "error" not in done
    chunks = [s["chunks_done"] for s in calibrated.polled]
    assert chunks == sorted(chunks)  # it only moves on
    projections = 30 * 4  # the tied output head never runs
    assert {k: done[k] for k in ("chunks_done", "tokens", "layers_tracking", "total_rows")} == {
        "chunks_done": 3,
        "tokens": 3 * 128,
        "layers_tracking": projections,
        "total_rows": projections * 3 * 128,
    }
    assert done["layers"] == projections + 1 and done["min_rows"] == done["max_rows"] == 3 * 128


def test_the_matrix_is_the_one_compute_imatrix_makes_of_the_same_chunks(
    server: Server, calibrated: Calibrated, oracle: Oracle
) -> None:
    downloaded = read_imatrix(calibrated.matrix_file)
    assert calibrated.polled[-1]["imatrix"] == f"sha256:{downloaded.digest()}"
    assert downloaded.digest() == oracle.digest
    assert (downloaded.datasets, downloaded.chunk_count, downloaded.chunk_size) == (
        ("argparse.py",),
        3,
        128,
    )
    saved = server.home / "imatrix" / f"{STORE_NAME}.gguf"
    assert calibrated.applied["saved_imatrix"] == str(saved)
    assert saved.read_bytes() == calibrated.matrix_file.read_bytes()


def test_apply_serves_what_isq_q8_with_the_imatrix_loads(
    server: Server, calibrated: Calibrated, oracle: Oracle
) -> None:
    digest = calibrated.polled[-1]["imatrix"]
    applied = calibrated.applied
    assert (applied["quantization"], applied["imatrix"], applied["previous"]) == (
        "q8",
        digest,
        None,
    )
    assert applied["changed"] is True and applied["status"] == "loaded"
    assert (calibrated.card["quantization"], calibrated.card["imatrix"]) == ("q8", digest)
    assert calibrated.answers == oracle.answers
    assert calibrated.answers != oracle.plain_q8_answers
    assert all(calibrated.answers)
    assert f"re-quantized (isq none -> q8, imatrix {digest[:23]}" in server.live.log.read_text()


def test_mistralrs_bodies_apply_the_same_matrix_for_the_models_method(
    calibrated: Calibrated,
) -> None:
    """``{}`` (mistral.rs's apply) and ``{"ggml_type": "Q8_0"}``: q8 for the same matrix, which
    the model holds already."""
    digest = calibrated.polled[-1]["imatrix"]
    for answer in (calibrated.again, calibrated.again_q8_0):
        assert (answer["quantization"], answer["imatrix"], answer["changed"]) == (
            "q8",
            digest,
            False,
        )
        assert answer["state"] == "done" and answer["collecting"] is False
    assert calibrated.again_q8_0["ggml_type"] == "Q8_0"
