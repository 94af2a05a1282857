"""Images on the Anthropic and Responses APIs, live on the tiny random Idefics3 (SmolVLM)
checkpoint through the official SDKs (strict): images inside Anthropic tool_result blocks and
beside tool blocks, and Responses ``input_image`` parts, reach the model as transformers sees
them (same prompt token count, same greedy text), and a text model refuses them as chat does."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import torch
from PIL import Image

from inferd.server.openai_tools import assistant_calls
from inferd.structured.tool_syntax import choose
from tests.models.test_idefics3_processor import generated
from tests.server.live import LiveServer, live_server
from tests.server.test_vision_live import data_url, png_bytes

NEW = 8
QUESTION = "What is in this picture?"
CAT = generated(70, 50, seed=1)
DOG = generated(300, 200, seed=2)  # more tiles than CAT


@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media-apis")
    (root / "cat.png").write_bytes(png_bytes(CAT))
    return root


@pytest.fixture(scope="module")
def vision(
    tiny_idefics3: tuple[Path, Any, Any], media_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("media-apis-serve") / "serve.log"
    args = ["-m", str(tiny_idefics3[0]), "--dtype", "f32", "--allowed-media-root", str(media_root)]
    args += ["--responses-store", ":memory:"]
    with live_server(args, log) as live:
        yield live


@pytest.fixture(scope="module")
def model_id(vision: LiveServer) -> str:
    return str(httpx.get(vision.api + "/models", timeout=10).json()["data"][0]["id"])


@pytest.fixture(scope="module")
def oai(vision: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=vision.api, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as client:
        yield client


@pytest.fixture(scope="module")
def claude(vision: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=vision.url, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as client:
        yield client


def reference(
    tiny_idefics3: tuple[Path, Any, Any], messages: list[Any], images: list[Image.Image]
) -> tuple[int, str]:
    """transformers' prompt length and greedy reply for parts-only chat messages."""
    _, hf, processor = tiny_idefics3
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[images], return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    return inputs["input_ids"].shape[1], processor.tokenizer.decode(new, skip_special_tokens=True)


def text(value: str) -> dict[str, str]:
    return {"type": "text", "text": value}


def image_block(image: Image.Image) -> dict[str, Any]:
    data = base64.b64encode(png_bytes(image)).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


# -- Anthropic: images in and beside tool results ---------------------------------------------


def conversation(last: list[Any]) -> list[Any]:
    """A tool call in the history, then the user's turn ``last`` (answering it)."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "take_photo", "input": {}}
    return [
        {"role": "user", "content": "Take a photo, please."},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": last},
    ]


def as_transformers(tiny_idefics3: tuple[Path, Any, Any], last: list[Any]) -> list[Any]:
    """``conversation(...)`` as transformers' processor takes it: the call written in the
    model's tool syntax (its template takes no tools), ``last`` as parts."""
    fmt = choose(tiny_idefics3[2].chat_template)
    assert not fmt.in_template
    call = assistant_calls("", [("toolu_1", "take_photo", "{}")], fmt)["content"]
    return [
        {"role": "user", "content": [text("Take a photo, please.")]},
        {"role": "assistant", "content": [text(call)]},
        {"role": "user", "content": last},
    ]


def ask_claude(claude: anthropic.Anthropic, model_id: str, messages: list[Any]) -> tuple[int, str]:
    msg = claude.messages.create(
        model=model_id, max_tokens=NEW, messages=messages, extra_body={"temperature": 0}
    )
    counted = claude.messages.count_tokens(model=model_id, messages=messages)
    assert counted.input_tokens == msg.usage.input_tokens
    return msg.usage.input_tokens, "".join(b.text for b in msg.content if b.type == "text")


def test_an_image_inside_a_tool_result_reaches_the_model(
    claude: anthropic.Anthropic, model_id: str, tiny_idefics3: tuple[Path, Any, Any]
) -> None:
    def result(*content: Any) -> list[Any]:
        block = {"type": "tool_result", "tool_use_id": "toolu_1", "content": list(content)}
        return [block, text(QUESTION)]

    sent = ask_claude(claude, model_id, conversation(result(text("Here:"), image_block(CAT))))
    # the generic tool wrapping, the image part in its place inside it
    expected = [
        text("<tool_response>\nHere:"),
        {"type": "image"},
        text("\n</tool_response>" + QUESTION),
    ]
    assert sent == reference(tiny_idefics3, as_transformers(tiny_idefics3, expected), [CAT])
    without = claude.messages.count_tokens(
        model=model_id, messages=conversation(result(text("Here:")))
    )
    assert sent[0] > without.input_tokens + 16  # the image's tile tokens
    other = ask_claude(claude, model_id, conversation(result(text("Here:"), image_block(DOG))))
    assert other != sent  # another image: its own tiles and reply, as transformers has them
    assert other == reference(tiny_idefics3, as_transformers(tiny_idefics3, expected), [DOG])


def test_a_message_mixing_images_and_tool_blocks(
    claude: anthropic.Anthropic, model_id: str, tiny_idefics3: tuple[Path, Any, Any]
) -> None:
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [image_block(DOG)],
    }
    last = [result, image_block(CAT), text(QUESTION)]  # two images, in this order
    sent = ask_claude(claude, model_id, conversation(last))
    expected = [
        text("<tool_response>\n"),
        {"type": "image"},
        text("\n</tool_response>"),
        {"type": "image"},
        text(QUESTION),
    ]
    messages = as_transformers(tiny_idefics3, expected)
    assert sent == reference(tiny_idefics3, messages, [DOG, CAT])
    swapped = [{**result, "content": [image_block(CAT)]}, image_block(DOG), text(QUESTION)]
    assert ask_claude(claude, model_id, conversation(swapped)) == reference(
        tiny_idefics3, messages, [CAT, DOG]
    )


def test_images_in_an_assistant_turn_are_still_refused(
    claude: anthropic.Anthropic, model_id: str
) -> None:
    messages: Any = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [image_block(CAT)]},
        {"role": "user", "content": "And?"},
    ]
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=model_id, max_tokens=1, messages=messages)
    assert "messages.1.content: images are accepted in user messages only" in str(caught.value)


# -- Responses: input_image -------------------------------------------------------------------


def image_input(url: str, detail: str = "auto") -> list[Any]:
    parts = [
        {"type": "input_image", "image_url": url, "detail": detail},
        {"type": "input_text", "text": QUESTION},
    ]
    return [{"role": "user", "content": parts}]


def test_responses_input_image_matches_chat_completions(
    oai: openai.OpenAI, model_id: str, media_root: Path, tiny_idefics3: tuple[Path, Any, Any]
) -> None:
    url = data_url(png_bytes(CAT))
    chat = oai.chat.completions.create(
        model=model_id,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        max_tokens=NEW,
        temperature=0,
    )
    assert chat.usage is not None
    expected = (chat.usage.prompt_tokens, chat.choices[0].message.content)
    parts = [{"type": "image"}, text(QUESTION)]
    assert expected == reference(tiny_idefics3, [{"role": "user", "content": parts}], [CAT])
    for source in (url, (media_root / "cat.png").as_uri()):
        for detail in ("auto", "low"):
            response = oai.responses.create(
                model=model_id,
                input=image_input(source, detail),  # type: ignore[arg-type]
                max_output_tokens=NEW,
                temperature=0,
            )
            assert response.usage is not None
            assert (response.usage.input_tokens, response.output_text) == expected
    queued = oai.responses.create(
        model=model_id,
        input=image_input(url),  # type: ignore[arg-type]
        max_output_tokens=NEW,
        temperature=0,
        background=True,
    )
    deadline = time.monotonic() + 60
    while (done := oai.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert (done.usage.input_tokens if done.usage else 0, done.output_text) == expected
    items = oai.responses.input_items.list(response.id)
    assert items.data[0].type == "message"
    assert items.data[0].content[0].type == "input_image"  # kept as sent


def test_a_stored_image_is_seen_again_in_the_next_turn(oai: openai.OpenAI, model_id: str) -> None:
    first = oai.responses.create(
        model=model_id,
        input=image_input(data_url(png_bytes(DOG))),  # type: ignore[arg-type]
        max_output_tokens=2,
        temperature=0,
    )
    second = oai.responses.create(
        model=model_id,
        previous_response_id=first.id,
        input="And now?",
        max_output_tokens=2,
        temperature=0,
    )
    assert first.usage is not None and second.usage is not None
    # the whole first turn, its image's tokens included, is in the second's prompt
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_truncation_drops_an_old_turn_with_its_image(oai: openai.OpenAI, model_id: str) -> None:
    def ask(image: Image.Image, previous: str | None, room: int) -> Any:
        return oai.responses.create(
            model=model_id,
            input=image_input(data_url(png_bytes(image))),  # type: ignore[arg-type]
            previous_response_id=previous,
            max_output_tokens=room,
            truncation="auto",
            temperature=0,
        )

    first = ask(DOG, None, 2)
    alone = ask(CAT, None, 2)
    # the tiny model has 512 positions: both images and this much room do not fit together
    room = 512 - alone.usage.input_tokens - 4
    assert first.usage.input_tokens + alone.usage.input_tokens + room > 512
    second = ask(CAT, first.id, room)
    assert second.status in ("completed", "incomplete")
    # the first turn's message (and its image) dropped; its short reply may stay
    assert alone.usage.input_tokens <= second.usage.input_tokens < alone.usage.input_tokens + 8


def test_bad_input_images_are_refused_by_path(oai: openai.OpenAI, model_id: str) -> None:
    cases = [
        (image_input("file:///etc/passwd"), "input.0.content.0.image_url: "),
        (image_input(data_url(b"not a png")), "input.0.content.0.image_url"),
        (image_input(data_url(png_bytes(CAT)), "tiny"), "input.0.content.0.detail must be"),
        (
            [{"role": "user", "content": [{"type": "input_image", "file_id": 7}]}],
            "input.0.content.0.file_id must be a string",
        ),
        (
            [
                {"role": "user", "content": "Hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "input_image", "image_url": data_url(b"x")}],
                },
            ],
            "input.1.content.0: images are accepted in user messages only",
        ),
    ]
    for given, message in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            oai.responses.create(model=model_id, input=given, max_output_tokens=1)  # type: ignore[arg-type]
        assert message in str(caught.value), caught.value


def test_a_text_model_refuses_input_images_as_chat_does(client: openai.OpenAI, model: str) -> None:
    url = data_url(png_bytes(CAT))
    with pytest.raises(openai.BadRequestError) as by_chat:
        client.chat.completions.create(
            model=model,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
            ],
            max_tokens=1,
        )
    with pytest.raises(openai.BadRequestError) as by_responses:
        client.responses.create(
            model=model,
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": url}]}],  # type: ignore[list-item]
            max_output_tokens=1,
        )
    chat_error, responses_error = by_chat.value.body, by_responses.value.body
    assert isinstance(chat_error, dict) and isinstance(responses_error, dict)
    assert chat_error["code"] == responses_error["code"] == "unsupported_modality"
    assert chat_error["param"] == "messages.0.content.0"
    assert responses_error["param"] == "input.0.content.0"
    assert responses_error["message"] == chat_error["message"].replace("messages.0", "input.0")
