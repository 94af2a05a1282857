"""Skills through the real CLI (`inferd serve --skills-dir DIR`) on the default model: the
official ``openai`` SDK's ``client.skills`` against /v1/skills, the upload checks' refusals
as 4xx in OpenAI's envelope (and the folder unchanged after them), the changes guarded as
admin routes, and the agent loop: the model, forced to call ``load_skill`` (SmolLM2-135M calls
a tool only when forced), reads the skill's body as the tool's result.

The server takes API keys and an admin key, so every route is reached as a client would.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from inferd.agent.config import AgentConfig
from inferd.server.app import build_app
from inferd.server.options import ServerOptions
from tests.agent.test_skills import zipped
from tests.server.live import LiveServer, live_server
from tests.server.spec_check import parse_sse

USER_KEY = "user-key"
ADMIN_KEY = "admin-secret"
USER = {"Authorization": f"Bearer {USER_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
RECIPE_BODY = "# Recipes\nAlways list the ingredients first, then the steps.\n"
WEATHER_BODY = "# Weather reports\nGive the temperature in Celsius, then the wind speed.\n"
BODIES = {"recipes": RECIPE_BODY, "weather-report": WEATHER_BODY}


def skill_md(name: str, description: str, body: str = "# Notes\n") -> bytes:
    return f"---\nname: {name}\ndescription: {description}\n---\n{body}".encode()


@pytest.fixture(scope="module")
def skills_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder, with one skill laid out by hand before the server starts."""
    folder = tmp_path_factory.mktemp("skills")
    (folder / "recipes").mkdir()
    (folder / "recipes" / "SKILL.md").write_bytes(
        skill_md("recipes", "How to write a cooking recipe.", RECIPE_BODY)
    )
    return folder


@pytest.fixture(scope="module")
def server(
    smollm2_gguf: Path, skills_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("skills-serve") / "serve.log"
    args = ["-m", str(smollm2_gguf), "--skills-dir", str(skills_dir), "--max-tool-rounds", "2"]
    args += ["--api-key", USER_KEY, "--admin-key", ADMIN_KEY, "--access-log-format", "off"]
    with live_server(args, log) as live:
        yield live


def _sdk(server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.api, api_key=key, max_retries=0, _strict_response_validation=True
    )


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


def _upload(server: LiveServer, files: list[tuple[str, bytes]], **extra: Any) -> httpx.Response:
    parts = [("files", (path, content)) for path, content in files]
    headers = ADMIN | extra.pop("headers", {})
    return httpx.post(server.api + "/skills", files=parts, headers=headers, timeout=30, **extra)


def _listed(server: LiveServer) -> list[str]:
    resp = httpx.get(server.api + "/skills", headers=USER, timeout=30)
    assert resp.status_code == 200, resp.text
    return sorted(s["id"] for s in resp.json()["data"])


def test_the_startup_line_lists_the_skill_tools(server: LiveServer, skills_dir: Path) -> None:
    text = server.log.read_text()
    assert f"skills from {skills_dir}" in text
    assert "skills skills: load_skill [allow], read_skill_file [allow]" in text


def test_the_openai_sdk_creates_lists_reads_and_deletes_a_skill(server: LiveServer) -> None:
    admin, user = _sdk(server, ADMIN_KEY), _sdk(server, USER_KEY)
    archive = zipped(
        ("pdf-tools/SKILL.md", skill_md("pdf-tools", "Split and merge PDF files.")),
        ("pdf-tools/scripts/split.sh", b"qpdf --split-pages in.pdf out.pdf\n"),
    )
    made = admin.skills.create(files=("pdf-tools.zip", archive, "application/zip"))
    assert (made.id, made.name, made.object) == ("pdf-tools", "pdf-tools", "skill")
    assert made.description == "Split and merge PDF files."
    files = [f["path"] for f in (made.model_extra or {})["files"]]
    assert files == ["SKILL.md", "scripts/split.sh"]
    # a folder's files, the SDK's other form (a list: the field is files[])
    admin.skills.create(
        files=[("SKILL.md", skill_md("csv-tools", "Clean CSV files.")), ("a.txt", b"A")]
    )
    assert {"pdf-tools", "csv-tools", "recipes"} <= {s.id for s in user.skills.list()}
    got = user.skills.retrieve("pdf-tools")
    assert (got.model_extra or {})["body"] == "# Notes\n"
    assert admin.skills.delete("pdf-tools").deleted
    assert admin.skills.delete("csv-tools").deleted
    with pytest.raises(openai.NotFoundError):
        user.skills.retrieve("pdf-tools")
    assert "pdf-tools" not in _listed(server)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ([("s.zip", zipped(("SKILL.md", skill_md("a", "A.")), ("../x", b"x")))], "'..' part"),
        ([("s.zip", zipped(("SKILL.md", skill_md("a", "A.")), symlink="evil"))], "is a symlink"),
        ([("SKILL.md", skill_md("a", "A.")), ("/etc/passwd", b"x")], "is absolute"),
        ([("SKILL.md", skill_md("a", "A.")), ("big.bin", b"x" * (1024 * 1024 + 1))], "over"),
        (
            [("SKILL.md", skill_md("a", "A."))] + [(f"{i}", b"x" * 2**20) for i in range(8)],
            "the upload is over 8388608 bytes",
        ),  # 1 MiB each, 8 MiB and more together
        ([("SKILL.md", b"no front matter")], "must start with a '---' line"),
        ([("SKILL.md", b"---\nname: a\n---\n")], "'description' must be"),
        ([("SKILL.md", skill_md("Not_A_Name", "A."))], "'name' must be 1-64"),
        ([("notes.txt", b"x")], "no SKILL.md"),
        ([("s.zip", b"PK\x03\x04 not really")], "not a readable zip"),
    ],
)
def test_an_upload_the_checks_refuse_is_a_400_and_changes_nothing(
    server: LiveServer, files: list[tuple[str, bytes]], message: str
) -> None:
    before = _listed(server)
    error = _error(_upload(server, files), 400)
    assert message in error["message"] and error["param"] == "files"
    assert _listed(server) == before


def test_a_taken_name_an_unknown_name_and_a_wrong_body_are_4xx(server: LiveServer) -> None:
    taken = _upload(server, [("SKILL.md", skill_md("recipes", "Another."))])
    assert _error(taken, 409)["code"] == "skill_exists"
    assert httpx.get(server.api + "/skills/recipes", headers=USER).json()["body"] == RECIPE_BODY
    for resp in (
        httpx.get(server.api + "/skills/no-such-skill", headers=USER),
        httpx.get(server.api + "/skills/..%2Fetc", headers=USER),
        httpx.delete(server.api + "/skills/no-such-skill", headers=ADMIN),
    ):
        assert _error(resp, 404)["code"] in ("skill_not_found", None)
    as_json = httpx.post(server.api + "/skills", json={"files": []}, headers=ADMIN)
    assert _error(as_json, 415)["code"] == "unsupported_media_type"
    other = httpx.post(server.api + "/skills", files=[("file", ("SKILL.md", b"x"))], headers=ADMIN)
    assert "unknown form field(s) file" in _error(other, 400)["message"]
    assert _error(httpx.get(server.api + "/skills?limit=0", headers=USER), 400)["param"] == "limit"


def test_changing_skills_takes_the_admin_key_and_reading_them_an_api_key(
    server: LiveServer,
) -> None:
    upload = [("files", ("SKILL.md", skill_md("keyed", "K.")))]
    as_user = httpx.post(server.api + "/skills", files=upload, headers=USER)
    assert _error(as_user, 401)["message"] == "the admin key is not valid for this server"
    assert _error(httpx.delete(server.api + "/skills/recipes", headers=USER), 401)
    assert _error(httpx.post(server.api + "/skills", files=upload), 401)
    assert _error(httpx.get(server.api + "/skills", headers=ADMIN), 401)  # not an API key
    assert "keyed" not in _listed(server) and "recipes" in _listed(server)


def test_an_upload_from_a_web_page_is_refused(server: LiveServer) -> None:
    """A multipart form needs no CORS preflight: the Origin a browser sends refuses it."""
    page = {"Origin": "http://evil.example"}
    resp = _upload(server, [("SKILL.md", skill_md("planted", "P."))], headers=page)
    assert _error(resp, 403)["code"] == "origin_not_allowed"
    assert "planted" not in _listed(server)


def test_the_model_loads_a_skill_and_reads_its_body(server: LiveServer) -> None:
    """An uploaded skill joins the tools at once; forced to call load_skill, the model names
    a skill (the schema's enum holds only theirs), and the call's result is its body."""
    weather = skill_md("weather-report", "How to write a weather report.", WEATHER_BODY)
    assert _upload(server, [("SKILL.md", weather)]).status_code == 200
    ask = {
        "model": "default",
        "messages": [{"role": "user", "content": "Write a short weather report for Lima."}],
        "temperature": 0,
        "max_tokens": 80,  # all rounds together: the call, then the answer
        "tool_choice": {"type": "function", "function": {"name": "load_skill"}},
        "max_tool_rounds": 1,
        "stream": True,
        "agent_progress": True,
    }
    resp = httpx.post(server.api + "/chat/completions", json=ask, headers=USER, timeout=300)
    assert resp.status_code == 200, resp.text
    notes = [json.loads(e.data) for e in parse_sse(resp.text) if e.name]
    call, result = notes
    assert (call["type"], call["name"]) == ("agent_tool_call", "load_skill")
    name = json.loads(call["arguments"])["name"]
    assert name in BODIES
    assert result["type"] == "agent_tool_result" and not result["is_error"]
    assert result["output"].startswith(f"# Skill: {name}\n\n{BODIES[name].rstrip()}")
    httpx.delete(server.api + "/skills/weather-report", headers=ADMIN).raise_for_status()


# -- in-process: what needs no model --------------------------------------------------------------


def _in_process(options: ServerOptions, method: str, path: str, **kw: Any) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app([], options))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:9") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(run())


def test_without_the_flag_the_routes_say_skills_are_off() -> None:
    resp = _in_process(ServerOptions(), "GET", "/v1/skills")
    assert "--skills-dir" in _error(resp, 404)["message"]


def test_with_the_admin_routes_off_skills_are_read_only(tmp_path: Path) -> None:
    options = ServerOptions(agent=AgentConfig(skills_dir=str(tmp_path)), admin_routes=False)
    upload = {"files": [("files", ("SKILL.md", skill_md("x", "X.")))]}
    refused = _in_process(options, "POST", "/v1/skills", **upload)
    assert "lifecycle routes are off" in _error(refused, 404)["message"]
    assert _in_process(options, "GET", "/skills").json()["data"] == []
    assert os.listdir(tmp_path) == []
