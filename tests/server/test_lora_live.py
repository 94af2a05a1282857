"""LoRA adapters served live: `inferd serve -m TINY --lora NAME=PATH ...` lists each adapter as
its own model with ``parent``, a chat naming it answers as transformers + peft do greedily, the
base answers as the base; a bad adapter stops the startup with its name in the error. The server
runs with ``--max-loras 1``: every change of adapter evicts the other, which changes no reply."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from inferd.config import EngineConfig
from inferd.serving.served import load_model
from tests.models.lora_tiny import save_random_adapter
from tests.models.tiny import save_tiny
from tests.server.live import LiveServer, live_server, lora_server_args

MESSAGES: list[Any] = [{"role": "user", "content": "Say something about foxes and 12345."}]
ADAPTERS = {"fox8": 8, "fox64": 64}
RUNTIME = "late16"  # loaded through POST /v1/load_lora_adapter
ADMIN = {"Authorization": "Bearer admin-secret"}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora_live")


@pytest.fixture(scope="module")
def references(folder: Path) -> dict[str | None, str]:
    """The expected greedy reply text of the base (None) and of each adapter."""
    hf_models: dict[str | None, Any] = {None: save_tiny("llama", folder / "base")}
    for i, (name, rank) in enumerate([*ADAPTERS.items(), (RUNTIME, 16)]):
        hf = save_tiny("llama", folder / f"hf_{name}")
        hf_models[name] = save_random_adapter(hf, folder / name, rank, seed=10 + i)
    served = load_model(
        folder / "base", EngineConfig(dtype="f32", kv_cache_tokens=512), progress=False
    )
    try:
        ids = served.chat_prompt(MESSAGES).ids
        eos = served.tokenizer.eos_token_id
        out: dict[str | None, str] = {}
        for key, model in hf_models.items():
            with torch.inference_mode():
                tokens = model.generate(
                    torch.tensor([ids]),
                    max_new_tokens=MAX_TOKENS,
                    do_sample=False,
                    eos_token_id=eos,
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                )[0, len(ids) :].tolist()
            if eos in tokens:
                tokens = tokens[: tokens.index(eos)]
            out[key] = served.tokenizer.decode(tokens)
    finally:
        served.shutdown()
    return out


@pytest.fixture(scope="module")
def server(folder: Path, references: dict[str | None, str]) -> Iterator[LiveServer]:
    with live_server(lora_server_args(folder, ADAPTERS), folder / "serve.log") as live:
        yield live


def _client(live: LiveServer) -> openai.OpenAI:
    """A strict client for a server of this module's own (the module's `server` has the
    shared `client` fixture); close it (`with`): a socket left to the collector warns."""
    return openai.OpenAI(
        base_url=live.api, api_key="unused", max_retries=0, _strict_response_validation=True
    )


def _reply(client: openai.OpenAI, model: str) -> str:
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    return r.choices[0].message.content or ""


def test_models_lists_adapters_with_parent(client: openai.OpenAI) -> None:
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    base = next(i for i, c in cards.items() if i not in ADAPTERS and i != "default")
    assert "parent" not in cards[base]
    for name in ADAPTERS:
        assert cards[name]["parent"] == base


def test_adapter_answers_as_peft_and_base_as_base(
    client: openai.OpenAI, references: dict[str | None, str]
) -> None:
    assert len(set(references.values())) == len(references)  # the adapters change the reply
    for name in ADAPTERS:
        assert _reply(client, name) == references[name], name
    assert _reply(client, "default") == references[None]


def test_one_slot_concurrent_adapters_each_answer_as_peft(
    server: LiveServer, client: openai.OpenAI, references: dict[str | None, str]
) -> None:
    """Requests to two adapters at once with one slot: one waits for the other's to finish."""
    evictions = server.metric("inferd_lora_evictions_total")
    names = [*ADAPTERS, *ADAPTERS, "default"]
    with ThreadPoolExecutor(len(names)) as pool:
        replies = list(pool.map(lambda name: _reply(client, name), names))
    for name, reply in zip(names, replies, strict=True):
        assert reply == references[None if name == "default" else name], name
    assert server.metric("inferd_lora_evictions_total") > evictions
    assert server.metric("inferd_lora_resident") == 1
    assert "LoRA fox" in server.log.read_text()  # the load/eviction log line


def test_unknown_adapter_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        _reply(client, "fox9")


@pytest.fixture(scope="module")
def alien(folder: Path) -> Path:
    """An adapter made for another base model (a wider one)."""
    wide = save_tiny("llama", folder / "wide", hidden_size=128)
    save_random_adapter(wide, folder / "wide_ad", rank=8, seed=3)
    return folder / "wide_ad"


def _admin(live: LiveServer, route: str, body: dict[str, Any], key: bool = True) -> Any:
    headers = ADMIN if key else {}
    return httpx.post(f"{live.api}/{route}", json=body, headers=headers, timeout=120)


def test_runtime_load_and_unload(
    server: LiveServer, client: openai.OpenAI, folder: Path, references: dict[str | None, str]
) -> None:
    body = {"lora_name": RUNTIME, "lora_path": str(folder / RUNTIME)}
    assert _admin(server, "load_lora_adapter", body, key=False).status_code == 401
    r = _admin(server, "load_lora_adapter", body)
    assert r.status_code == 200, r.text
    assert _admin(server, "load_lora_adapter", body).status_code == 409  # the name is taken
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert cards[RUNTIME]["parent"] == r.json()["parent"]
    assert _reply(client, RUNTIME) == references[RUNTIME]
    gone = {"lora_name": RUNTIME}
    assert _admin(server, "unload_lora_adapter", gone, key=False).status_code == 401
    assert _admin(server, "unload_lora_adapter", gone).status_code == 200
    assert RUNTIME not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        _reply(client, RUNTIME)
    assert _admin(server, "unload_lora_adapter", gone).status_code == 404
    assert _reply(client, "fox8") == references["fox8"]  # the others stay


def test_runtime_load_refuses_bad_adapters(
    server: LiveServer, client: openai.OpenAI, folder: Path, alien: Path
) -> None:
    deep = folder / "deep"  # json's parser would raise RecursionError (a 500 before)
    shutil.copytree(folder / "fox8", deep, dirs_exist_ok=True)
    (deep / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    for path, reason in (
        (alien, "another model"),
        (folder / "nowhere", "no such directory"),
        (deep, "nested more than 32 levels"),
    ):
        r = _admin(server, "load_lora_adapter", {"lora_name": "bad", "lora_path": str(path)})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "'bad'" in message and reason in message
    outside = _admin(server, "load_lora_adapter", {"lora_name": "bad", "lora_path": "/etc"})
    assert outside.status_code == 400 and "--lora-root" in outside.json()["error"]["message"]
    assert "bad" not in {m.id for m in client.models.list().data}


def test_adapter_for_another_base_stops_startup(folder: Path, alien: Path) -> None:
    cmd = [sys.executable, "-m", "inferd", "serve", "-m", str(folder / "base")]
    cmd += ["--dtype", "f32", "--port", "0", "--lora", f"fox8={folder / 'fox8'}"]
    cmd += ["--lora", f"alien={alien}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "'alien'" in proc.stderr and "another model" in proc.stderr


def test_config_file_serves_each_models_adapters(
    folder: Path, alien: Path, references: dict[str | None, str]
) -> None:
    """`lora` in a --config file: the model's adapters are listed with it as parent and
    answer as peft; one that cannot be served shows status error while the others serve."""
    config = folder / "models.toml"
    config.write_text(
        f'[tiny]\ndtype = "f32"\nmax_seq_len = 128\n[tiny.Plain]\nmodel_id = "{folder / "base"}"\n'
        f'[tiny.lora]\nfox64 = "{folder / "fox64"}"\nalien = "{alien}"\n'
    )
    args = ["--config", str(config), "--access-log-format", "off", "--max-loras", "1"]
    with live_server(args, folder / "serve_config.log") as live:
        deadline = time.monotonic() + 300
        while True:
            cards = {m["id"]: m for m in httpx.get(f"{live.api}/models").json()["data"]}
            if not {"loading", "reloading"} & {c.get("status") for c in cards.values()}:
                break
            assert time.monotonic() < deadline, cards
            time.sleep(0.5)
        assert cards["fox64"]["status"] == "loaded" and cards["fox64"]["parent"] == "base"
        assert cards["alien"]["status"] == "error"
        assert "another model" in _status_error(live, "alien")
        with _client(live) as client:
            assert _reply(client, "fox64") == references["fox64"]
            assert _reply(client, "base") == references[None]


def _status_error(live: LiveServer, model: str) -> str:
    r = httpx.post(f"{live.api}/chat/completions", json={"model": model, "messages": MESSAGES})
    assert r.status_code == 503, r.text
    message: str = r.json()["error"]["message"]
    return message
