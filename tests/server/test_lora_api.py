"""POST /v1/load_lora_adapter's checks that come before any model is touched (in-process, no
model needed): the adapter name is an identifier, and lora_path must lie under a --lora-root,
with one answer for every path outside whether or not it exists. Adapters are read live in
tests/server/test_lora_live.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferd.server.app import build_app
from inferd.server.options import ServerOptions


def _load(options: ServerOptions, *bodies: dict[str, Any]) -> list[httpx.Response]:
    app = build_app([], options)

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.post("/v1/load_lora_adapter", json=b) for b in bodies]

    return asyncio.run(run())


def _error(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text
    return dict(resp.json()["error"])


def test_runtime_loading_is_off_without_a_root(tmp_path: Path) -> None:
    (tmp_path / "ad").mkdir()
    [resp] = _load(ServerOptions(), {"lora_name": "ad", "lora_path": str(tmp_path / "ad")})
    err = _error(resp)
    assert err["code"] == "lora_path_refused" and err["param"] == "lora_path"
    assert "--lora-root" in err["message"]


def test_paths_outside_the_roots_all_get_one_answer(tmp_path: Path) -> None:
    root, outside = tmp_path / "adapters", tmp_path / "private"
    root.mkdir()
    (outside / "secret").mkdir(parents=True)
    os.symlink(outside, root / "link")  # inside as written, outside once resolved
    paths = [
        str(outside / "secret"),  # exists
        str(outside / "nothing"),  # does not
        "/etc",
        "/no/such/dir",
        f"{root}/../private/secret",
        str(root / "link" / "secret"),
        "adapters/relative",
        f"{root}/x\x00y",
    ]
    options = ServerOptions(lora_roots=(root,))
    bodies = [{"lora_name": "ad", "lora_path": p} for p in paths]
    messages = {_error(r)["message"] for r in _load(options, *bodies)}
    assert messages == {
        "lora_path must be an absolute path under a --lora-root directory of this server"
    }


@pytest.mark.parametrize("name", ["a b", "x" * 65, "<img src=x>", "-x", "a/b", "\u00e9t\u00e9"])
def test_adapter_names_must_be_identifiers(tmp_path: Path, name: str) -> None:
    options = ServerOptions(lora_roots=(tmp_path,))
    [resp] = _load(options, {"lora_name": name, "lora_path": str(tmp_path)})
    err = _error(resp)
    assert err["code"] == "invalid_lora_name" and err["param"] == "lora_name"
    assert len(err["message"]) < 300


def test_a_root_must_be_an_existing_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--lora-root .*not an existing directory"):
        ServerOptions(lora_roots=(tmp_path / "missing",))
