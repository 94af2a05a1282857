"""`inferd serve` on tiny random Gemma 3n directories (tests/models/tiny_gemma3n.py), through
the strict OpenAI SDK. The oracle: transformers' greedy text for the prompt its tokenizer's
chat template writes.

- a Gemma3nForCausalLM directory, served whole (``-m DIR --dtype f32``);
- a Gemma3nForConditionalGeneration directory cut by a MatFormer slice
  (``--matformer-config FILE --matformer-slice NAME``): the startup lines name the slice and
  say audio is served and images are not; the reply is transformers' model of the sliced
  config with the cut weights; an image is refused with a 400 in OpenAI's envelope (audio
  through the whole model: test_gemma3n_audio_live.py);
- a slice name the table lacks, or a table that is not one, stops the startup with a clear
  message.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.models.tiny_gemma3n import (
    MATFORMER_CSV,
    SLICE_NAME,
    media_embedders,
    multimodal_greedy,
    save_tiny_gemma3n_multimodal,
    save_tiny_gemma3n_text,
    slice_reference,
    text_model,
)
from tests.server.live import LiveServer, live_server

NEW = 8
MESSAGES = [{"role": "user", "content": "The quick brown fox watched the storm roll in."}]
SERVE = [sys.executable, "-m", "inferd", "serve", "--port", "0"]


def reference_reply(directory: Path, hf: Any, embedders: dict[str, Any] | None = None) -> str:
    """transformers' greedy reply to ``MESSAGES`` (its tokenizer's chat template); with
    ``embedders``, as Gemma3nForConditionalGeneration embeds its media ranges of ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    if embedders is not None:
        tokens = multimodal_greedy(hf, embedders, ids, NEW)
    else:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
        tokens = out[0, len(ids) :].tolist()
    return str(tok.decode(tokens, skip_special_tokens=True))


def chat(server: LiveServer, messages: list[Any]) -> Any:
    with openai.OpenAI(
        base_url=server.api, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as client:
        model = client.models.list().data[0].id
        return client.chat.completions.create(
            model=model, messages=messages, max_tokens=NEW, temperature=0.0
        )


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, str]]:
    directory = tmp_path_factory.mktemp("gemma3n-text")
    expected = reference_reply(directory, save_tiny_gemma3n_text(directory))
    log = directory / "serve.log"
    with live_server(["-m", str(directory), "--dtype", "f32"], log) as live:
        yield live, expected


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("matformer") / "MatFormer-config.csv"
    path.write_text(MATFORMER_CSV)
    return path


@pytest.fixture(scope="module")
def sliced(
    tmp_path_factory: pytest.TempPathFactory, table: Path
) -> Iterator[tuple[LiveServer, str]]:
    directory = tmp_path_factory.mktemp("gemma3n-mm")
    full, _ = save_tiny_gemma3n_multimodal(directory / "model")
    decoder, embedders = text_model(full), media_embedders(full)
    expected = reference_reply(directory / "model", slice_reference(decoder), embedders)
    assert expected != reference_reply(directory / "model", decoder, embedders)  # it shows
    args = ["-m", str(directory / "model"), "--dtype", "f32"]
    args += ["--matformer-config", str(table), "--matformer-slice", SLICE_NAME]
    with live_server(args, directory / "serve.log") as live:
        yield live, expected


def test_the_whole_model_replies_as_transformers(whole: tuple[LiveServer, str]) -> None:
    server, expected = whole
    reply = chat(server, MESSAGES)
    assert expected and reply.choices[0].message.content == expected
    assert reply.usage.completion_tokens == NEW


def test_a_slice_of_the_multimodal_checkpoint_replies_as_transformers_sliced_model(
    sliced: tuple[LiveServer, str],
) -> None:
    server, expected = sliced
    startup = server.log.read_text()
    assert f"matformer  slice '{SLICE_NAME}'" in startup
    assert "6 of 8 layers (skipped 3, 6), MLP widths 48, 64, 96, 128" in startup
    assert "gemma3n serves audio; its image encoder is not served" in startup
    assert chat(server, MESSAGES).choices[0].message.content == expected


def test_an_image_to_the_text_only_model_is_refused(sliced: tuple[LiveServer, str]) -> None:
    server, _ = sliced
    pixel = (
        "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8"
        "z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
    )
    parts = [{"type": "image_url", "image_url": {"url": pixel}}, {"type": "text", "text": "hi"}]
    with pytest.raises(openai.BadRequestError) as err:
        chat(server, [{"role": "user", "content": parts}])
    assert err.value.status_code == 400
    assert "image" in str(err.value.body)


@pytest.mark.parametrize(
    ("csv_text", "name", "says"),
    [
        (MATFORMER_CSV, "E9B", "--matformer-slice 'E9B' is not in"),
        ("a,b\n1,2\n", SLICE_NAME, "not a MatFormer config CSV"),
    ],
)
def test_a_bad_slice_stops_the_startup(tmp_path: Path, csv_text: str, name: str, says: str) -> None:
    save_tiny_gemma3n_text(tmp_path / "model")
    (tmp_path / "slices.csv").write_text(csv_text)
    command = [*SERVE, "-m", str(tmp_path / "model"), "--matformer-config"]
    command += [str(tmp_path / "slices.csv"), "--matformer-slice", name]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert says in result.stderr, result.stderr
