"""LoRA adapters across a reload of their base model, and adapters whose files change on disk,
on a live `inferd serve -m TINY --lora ...` (``--max-loras 1``).

Unloading the base unloads its adapters (they run on its engine); loading it again, by
POST /v1/models/reload or by a request for one of its adapters (auto-reload), registers every
adapter again from the same files, so each answers as it did before. An adapter whose files
changed since it was loaded shows status error after the reload while the others serve, and a
request that needs such an adapter read again answers 409 with what to do, in both APIs,
streamed or not; a streamed one ends with an error event, never as a finished reply."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.models.lora_tiny import save_random_adapter
from tests.models.tiny import save_tiny
from tests.server.live import LiveServer, live_server, lora_server_args

MESSAGES: list[Any] = [{"role": "user", "content": "Say something about foxes and 12345."}]
ADAPTERS = {"fox8": 8, "fox16": 16}
ADMIN = {"Authorization": "Bearer admin-secret"}
MAX_TOKENS = 8
CHANGED = "changed on disk"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lora_reload")
    save_tiny("llama", folder / "base")
    for i, (name, rank) in enumerate(ADAPTERS.items()):
        hf = save_tiny("llama", folder / f"hf_{name}")
        save_random_adapter(hf, folder / name, rank, seed=20 + i)
    return folder


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[LiveServer]:
    with live_server(lora_server_args(folder, ADAPTERS), folder / "serve.log") as live:
        yield live


def _chat(live: LiveServer, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(f"{live.api}/chat/completions", json=body | extra, timeout=300)


def _reply(live: LiveServer, model: str) -> str:
    r = _chat(live, model)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def _admin(live: LiveServer, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{live.api}/{route}", json=body, headers=ADMIN, timeout=300)


def _cards(live: LiveServer) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in httpx.get(f"{live.api}/models", timeout=30).json()["data"]}


def _base(live: LiveServer) -> str:
    return next(i for i, c in _cards(live).items() if "parent" not in c and i != "default")


def _copy_adapter(src: Path, dst: Path) -> None:
    dst.mkdir(exist_ok=True)
    for item in src.iterdir():
        shutil.copyfile(item, dst / item.name)


def _sse_data(live: LiveServer, path: str, body: dict[str, Any]) -> list[str]:
    headers = {"anthropic-version": "2023-06-01"} if path == "messages" else {}
    lines = []
    with httpx.stream(
        "POST", f"{live.api}/{path}", json=body, headers=headers, timeout=300
    ) as resp:
        assert resp.status_code == 200  # the headers went out before the engine failed it
        lines = [line for line in resp.iter_lines() if line]
    return lines


def test_reload_brings_the_adapters_back(server: LiveServer) -> None:
    base = _base(server)
    before = {name: _reply(server, name) for name in [*ADAPTERS, base]}
    assert len(set(before.values())) == len(before)  # each adapter changes the reply
    r = _admin(server, "models/unload", {"model_id": base, "drain_timeout": 5})
    assert r.status_code == 200, r.text
    cards = _cards(server)
    for name in ADAPTERS:
        assert cards[name]["status"] == "unloaded" and cards[name]["parent"] == base
    r = _admin(server, "models/reload", {"model_id": base})
    assert r.status_code == 200, r.text
    cards = _cards(server)
    for name in ADAPTERS:
        assert cards[name]["status"] == "loaded" and cards[name]["parent"] == base
    assert {name: _reply(server, name) for name in before} == before
    # Auto-reload: a request for an adapter loads its base, then the adapters, again.
    assert _admin(server, "models/unload", {"model_id": base}).status_code == 200
    assert _reply(server, "fox16") == before["fox16"]
    assert _cards(server)[base]["status"] == "loaded"
    assert {name: _reply(server, name) for name in before} == before


def test_changed_files_answer_409_saying_what_to_do(server: LiveServer, folder: Path) -> None:
    """An adapter loaded at runtime (attached only when first needed), whose files are then
    replaced by another adapter's: every API and stream refuses it with a clear 409, until it
    is unloaded and loaded again, when it serves the new files."""
    base = _base(server)
    expected_after = _reply(server, "fox16")
    _copy_adapter(folder / "fox8", folder / "late")
    body = {"lora_name": "late", "lora_path": str(folder / "late")}
    assert _admin(server, "load_lora_adapter", body).status_code == 200
    _copy_adapter(folder / "fox16", folder / "late")  # the files change after loading

    r = _chat(server, "late")
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "lora_adapter_changed" and error["param"] == "model"
    assert "'late'" in error["message"] and CHANGED in error["message"]
    assert "/v1/load_lora_adapter" in error["message"]

    anthropic = {"model": "late", "max_tokens": MAX_TOKENS, "messages": MESSAGES}
    headers = {"anthropic-version": "2023-06-01"}
    r = httpx.post(f"{server.api}/messages", json=anthropic, headers=headers, timeout=300)
    assert r.status_code == 409, r.text
    assert r.json()["type"] == "error" and CHANGED in r.json()["error"]["message"]

    lines = _sse_data(
        server,
        "chat/completions",
        {"model": "late", "messages": MESSAGES} | {"max_tokens": MAX_TOKENS, "stream": True},
    )
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["error"]["code"] == "lora_adapter_changed", last
    assert CHANGED in last["error"]["message"]
    chunks = [json.loads(line[6:]) for line in lines[:-2] if line.startswith("data: ")]
    assert not any(c["choices"][0]["finish_reason"] for c in chunks if c.get("choices"))

    lines = _sse_data(server, "messages", anthropic | {"stream": True})
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert events[-1] == "error" and "message_stop" not in events, events
    assert CHANGED in json.loads(lines[-1].removeprefix("data: "))["error"]["message"]

    # What the message says to do: unload, load again; it then serves the new files.
    assert _admin(server, "unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    r = _admin(server, "load_lora_adapter", body)
    assert r.status_code == 200 and r.json()["parent"] == base, r.text
    assert _reply(server, "late") == expected_after
    assert _admin(server, "unload_lora_adapter", {"lora_name": "late"}).status_code == 200


def test_reload_with_changed_files_shows_that_adapter_in_error(
    server: LiveServer, folder: Path
) -> None:
    base = _base(server)
    before = {name: _reply(server, name) for name in ADAPTERS}
    _copy_adapter(folder / "fox8", folder / "moved")
    body = {"lora_name": "moved", "lora_path": str(folder / "moved")}
    assert _admin(server, "load_lora_adapter", body).status_code == 200
    assert _reply(server, "moved") == before["fox8"]
    assert _admin(server, "models/unload", {"model_id": base}).status_code == 200
    _copy_adapter(folder / "fox16", folder / "moved")
    assert _admin(server, "models/reload", {"model_id": base}).status_code == 200
    card = _cards(server)["moved"]
    assert card["status"] == "error" and card["parent"] == base
    assert CHANGED in card["error"]
    r = _chat(server, "moved")
    assert r.status_code == 503 and CHANGED in r.json()["error"]["message"], r.text
    assert {name: _reply(server, name) for name in ADAPTERS} == before  # the rest serve
    # An adapter in error is unloaded like any other, and its name is free again.
    assert _admin(server, "unload_lora_adapter", {"lora_name": "moved"}).status_code == 200
    assert "moved" not in _cards(server)
    assert _admin(server, "load_lora_adapter", body).status_code == 200
    assert _reply(server, "moved") == before["fox16"]
