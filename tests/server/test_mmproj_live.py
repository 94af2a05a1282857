"""`inferd serve -m lm.gguf --mmproj mmproj.gguf`: the tiny Idefics3 (SmolVLM) as llama.cpp
ships it (tests/models/tiny_mmproj.py). The startup lines name the projector, /v1/models says
the model takes images, and an image sent through the OpenAI SDK (strict) gets transformers'
greedy reply with the image's tokens counted; a projector that does not fit stops the command
before it serves, with the reason."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from inferd.cli import main
from tests.models.test_idefics3_processor import generated
from tests.models.tiny_mmproj import write_mmproj, write_smolvlm_ggufs
from tests.server.live import LiveServer, live_server
from tests.server.test_vision_live import NEW, data_url, image_turn, png_bytes, reference


@pytest.fixture(scope="module")
def ggufs(
    tiny_idefics3: tuple[Path, Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    _, hf, processor = tiny_idefics3
    return write_smolvlm_ggufs(hf, processor.image_processor, tmp_path_factory.mktemp("mmproj"))


@pytest.fixture(scope="module")
def server(
    ggufs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("mmproj-serve") / "serve.log"
    lm, proj = ggufs
    with live_server(["-m", str(lm), "--mmproj", str(proj), "--dtype", "f32"], log) as live:
        yield live


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=server.api, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as client:
        yield client


def test_startup_names_the_projector_and_models_lists_images(
    server: LiveServer, ggufs: tuple[Path, Path]
) -> None:
    log = server.log.read_text()
    line = next(x for x in log.splitlines() if "projector " in x)
    assert str(ggufs[1]) in line and "idefics3" in line and "32 px tiles of 4 tokens" in line
    cards = httpx.get(server.api + "/models", timeout=10).json()["data"]
    assert [c["id"] for c in cards] == ["lm"]
    assert cards[0]["modalities"] == {"input": ["text", "image"], "output": ["text"]}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_an_image_gets_the_transformers_reply(
    oai: openai.OpenAI, tiny_idefics3: tuple[Path, Any, Any], stream: bool
) -> None:
    image = generated(300, 200, seed=3)  # splits into tiles
    question = "What is in this picture?"
    prompt_tokens, new_ids, text = reference(tiny_idefics3, image, question)
    ask: dict[str, Any] = {
        "model": "lm",
        "messages": image_turn(data_url(png_bytes(image)), question),
        "max_tokens": NEW,
        "temperature": 0,
    }
    if stream:
        chunks = list(
            oai.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
        )
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        reply = oai.chat.completions.create(**ask)
        answer, usage = reply.choices[0].message.content or "", reply.usage
    assert usage is not None
    assert usage.prompt_tokens == prompt_tokens  # every tile's <image> tokens counted
    assert usage.completion_tokens == len(new_ids)
    assert answer == text


def test_a_projector_that_does_not_fit_stops_serve(
    ggufs: tuple[Path, Path],
    tiny_idefics3: tuple[Path, Any, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, hf, processor = tiny_idefics3
    narrow = tmp_path / "narrow.gguf"
    write_mmproj(hf, processor.image_processor, narrow, connector_width=32)
    base = ["serve", "-m", str(ggufs[0]), "--port", "0", "--dtype", "f32"]
    assert main([*base, "--mmproj", str(narrow)]) == 2
    err = capsys.readouterr()
    assert "gives 32-wide embeddings" in err.err and "language model is 64 wide" in err.err
    assert "listening" not in err.out
    config = tmp_path / "models.json"
    config.write_text('{"a": {"GGUF": {"model_id": "x.gguf"}}}')
    assert main(["serve", "--config", str(config), "--mmproj", str(ggufs[1])]) == 2
    assert "--mmproj goes with -m" in capsys.readouterr().err
