"""/v1/files through the real CLI (`inferd serve`) on the default model: the official
``openai`` SDK's ``client.files`` in strict mode, replies checked against OpenAI's published
schemas, the refusals as 4xx in OpenAI's envelope (changing nothing), ownership per API key,
and files used as inputs: a text file's content reaching the prompt on chat and on the
Responses API.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.live import LiveServer, live_server
from tests.server.spec_check import check_openai

KEY_A, KEY_B = "key-a", "key-b"
MAX_FILE_BYTES = 100_000
NOTES = b"The secret ingredient of the soup is a spoonful of smoked paprika and lemon zest.\n"


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("files")


@pytest.fixture(scope="module")
def server(
    smollm2_gguf: Path, files_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("files-serve") / "serve.log"
    args = ["-m", str(smollm2_gguf), "--files-dir", str(files_dir)]
    args += ["--max-file-bytes", str(MAX_FILE_BYTES), "--responses-store", ":memory:"]
    args += ["--api-key", KEY_A, "--api-key", KEY_B, "--access-log-format", "off"]
    with live_server(args, log) as live:
        yield live


def _sdk(server: LiveServer, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.api, api_key=key, max_retries=0, _strict_response_validation=True
    )


def _auth(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


def _ids(server: LiveServer, key: str = KEY_A) -> list[str]:
    resp = httpx.get(server.api + "/files", headers=_auth(key), timeout=30)
    assert resp.status_code == 200, resp.text
    return [f["id"] for f in resp.json()["data"]]


def test_the_openai_sdk_creates_lists_reads_and_deletes_a_file(
    server: LiveServer, files_dir: Path
) -> None:
    client = _sdk(server)
    made = client.files.create(file=("notes.txt", NOTES, "text/plain"), purpose="user_data")
    assert made.id.startswith("file-") and made.object == "file"
    assert (made.filename, made.bytes, made.purpose) == ("notes.txt", len(NOTES), "user_data")
    check_openai("OpenAIFile", made.model_dump(exclude_none=True))
    assert client.files.retrieve(made.id) == made
    assert client.files.content(made.id).content == NOTES
    listed = client.files.list(purpose="user_data")
    assert [f.id for f in listed.data] == [made.id]
    raw = httpx.get(server.api + "/files", headers=_auth(), timeout=30).json()
    check_openai("ListFilesResponse", raw)
    # stored by content digest: the second upload of the same bytes shares the blob
    again = client.files.create(file=("copy.txt", NOTES), purpose="assistants")
    blobs = list((files_dir / "blobs").iterdir())
    assert len(blobs) == 1 and blobs[0].read_bytes() == NOTES
    assert [f.id for f in client.files.list(order="asc").data][-2:] == [made.id, again.id]
    page = client.files.list(limit=1, order="asc", after=made.id)
    assert [f.id for f in page.data] == [again.id]
    deleted = client.files.delete(made.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (made.id, True, "file")
    check_openai("DeleteFileResponse", deleted.model_dump())
    assert blobs[0].is_file()  # still named by the copy
    client.files.delete(again.id)
    assert not blobs[0].exists()
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(made.id)


def test_another_key_sees_none_of_the_files(server: LiveServer) -> None:
    mine = _sdk(server, KEY_A).files.create(file=("a.txt", b"mine"), purpose="user_data")
    theirs = _sdk(server, KEY_B)
    assert mine.id not in [f.id for f in theirs.files.list().data]
    for path in (f"/files/{mine.id}", f"/files/{mine.id}/content"):
        error = _error(httpx.get(server.api + path, headers=_auth(KEY_B), timeout=30), 404)
        assert error["code"] == "file_not_found"
    resp = httpx.delete(server.api + f"/files/{mine.id}", headers=_auth(KEY_B), timeout=30)
    _error(resp, 404)
    assert _sdk(server, KEY_A).files.content(mine.id).content == b"mine"  # untouched


def test_a_file_over_the_limit_is_a_413_and_nothing_is_stored(server: LiveServer) -> None:
    before = _ids(server)
    resp = httpx.post(
        server.api + "/files",
        files={"file": ("big.bin", b"x" * (MAX_FILE_BYTES + 1))},
        data={"purpose": "user_data"},
        headers=_auth(),
        timeout=30,
    )
    error = _error(resp, 413)
    assert error["code"] == "file_too_large" and "--max-file-bytes" in error["message"]
    assert _ids(server) == before


@pytest.mark.parametrize(
    ("form", "files", "param"),
    [
        ({"purpose": "world-domination"}, {"file": ("a.txt", b"a")}, "purpose"),
        ({}, {"file": ("a.txt", b"a")}, "purpose"),
        ({"purpose": "user_data"}, {}, "file"),
        ({"purpose": "user_data", "file": "not a file"}, {}, "file"),
        ({"purpose": "user_data", "colour": "red"}, {"file": ("a.txt", b"a")}, "colour"),
    ],
)
def test_a_bad_upload_is_a_400_naming_the_field(
    server: LiveServer, form: dict[str, str], files: dict[str, Any], param: str
) -> None:
    before = _ids(server)
    resp = httpx.post(
        server.api + "/files", data=form, files=files or None, headers=_auth(), timeout=30
    )
    if not files:  # an urlencoded form
        error = _error(resp, 415)
    else:
        error = _error(resp, 400)
        assert error["param"] == param
    assert _ids(server) == before


def test_an_empty_multipart_body_is_a_400(server: LiveServer) -> None:
    headers = _auth() | {"Content-Type": "multipart/form-data; boundary=xyz"}
    resp = httpx.post(server.api + "/files", content=b"--xyz--\r\n", headers=headers, timeout=30)
    _error(resp, 400)


def test_a_traversal_looking_filename_is_just_a_name(server: LiveServer, files_dir: Path) -> None:
    client = _sdk(server)
    made = client.files.create(file=("../../etc/passwd", b"root:x:0:0"), purpose="user_data")
    assert made.filename == "passwd"
    assert client.files.content(made.id).content == b"root:x:0:0"
    assert sorted(p.name for p in files_dir.iterdir() if not p.name.startswith("files.sqlite3"))
    assert not (files_dir.parent.parent / "etc").exists()
    client.files.delete(made.id)


def test_a_web_page_cannot_upload(server: LiveServer) -> None:
    before = _ids(server)
    resp = httpx.post(
        server.api + "/files",
        files={"file": ("a.txt", b"a")},
        data={"purpose": "user_data"},
        headers=_auth() | {"Origin": "https://evil.example"},
        timeout=30,
    )
    assert _error(resp, 403)["code"] == "origin_not_allowed"
    assert _ids(server) == before


def test_the_content_is_an_attachment_never_a_page(server: LiveServer) -> None:
    client = _sdk(server)
    made = client.files.create(file=("x.html", b"<script>alert(1)</script>"), purpose="user_data")
    resp = httpx.get(server.api + f"/files/{made.id}/content", headers=_auth(), timeout=30)
    assert resp.headers["content-disposition"].startswith("attachment")
    assert resp.headers["x-content-type-options"] == "nosniff"
    client.files.delete(made.id)


# -- files as inputs ------------------------------------------------------------------------


def _chat_usage(server: LiveServer, content: Any) -> int:
    reply = _sdk(server).chat.completions.create(
        model="default", messages=[{"role": "user", "content": content}], max_tokens=1
    )
    assert reply.usage is not None
    return reply.usage.prompt_tokens


def test_a_text_file_reaches_the_chat_prompt(server: LiveServer) -> None:
    client = _sdk(server)
    made = client.files.create(file=("notes.txt", NOTES), purpose="user_data")
    question = {"type": "text", "text": "What is in the soup?"}
    bare = _chat_usage(server, [question])
    by_id = _chat_usage(server, [{"type": "file", "file": {"file_id": made.id}}, question])
    data = base64.b64encode(NOTES).decode()
    inline = _chat_usage(
        server,
        [{"type": "file", "file": {"file_data": data, "filename": "notes.txt"}}, question],
    )
    as_text = _chat_usage(
        server,
        [{"type": "text", "text": f"notes.txt:\n{NOTES.decode()}"}, question],
    )
    assert by_id == inline > bare + 15  # the notes' tokens, with the filename
    assert as_text <= by_id
    client.files.delete(made.id)


def test_a_text_file_reaches_the_responses_prompt(server: LiveServer) -> None:
    client = _sdk(server)
    made = client.files.create(file=("notes.md", NOTES), purpose="user_data")
    question = {"type": "input_text", "text": "What is in the soup?"}

    def tokens(parts: list[dict[str, Any]]) -> int:
        raw = client.responses.with_raw_response.create(
            model="default",
            input=[{"role": "user", "content": parts}],  # type: ignore[misc, list-item]
            max_output_tokens=16,
            store=False,
        )
        check_openai("Response", raw.http_response.json())
        response = raw.parse()
        assert response.usage is not None
        return response.usage.input_tokens

    bare = tokens([question])
    by_id = tokens([{"type": "input_file", "file_id": made.id}, question])
    data = "data:text/markdown;base64," + base64.b64encode(NOTES).decode()
    inline = tokens([{"type": "input_file", "file_data": data, "filename": "notes.md"}, question])
    assert by_id == inline > bare + 15
    client.files.delete(made.id)


def test_a_file_the_model_cannot_take_is_a_400_naming_its_type(server: LiveServer) -> None:
    client = _sdk(server)
    made = client.files.create(file=("archive.zip", b"PK\x03\x04 not text"), purpose="user_data")
    resp = httpx.post(
        server.api + "/chat/completions",
        json={
            "model": "default",
            "messages": [
                {"role": "user", "content": [{"type": "file", "file": {"file_id": made.id}}]}
            ],
        },
        headers=_auth(),
        timeout=60,
    )
    error = _error(resp, 400)
    assert "archive.zip" in error["message"] and "zip" in error["message"]
    assert error["param"] == "messages.0.content.0.file"
    client.files.delete(made.id)


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_an_unknown_or_foreign_file_id_is_a_404(server: LiveServer, route: str) -> None:
    theirs = _sdk(server, KEY_B).files.create(file=("b.txt", b"theirs"), purpose="user_data")
    for file_id in ("file-doesnotexist", theirs.id):
        if route == "chat":
            part: dict[str, Any] = {"type": "file", "file": {"file_id": file_id}}
            body: dict[str, Any] = {"messages": [{"role": "user", "content": [part]}]}
            path = "/chat/completions"
        else:
            part = {"type": "input_file", "file_id": file_id}
            body = {"input": [{"role": "user", "content": [part]}]}
            path = "/responses"
        resp = httpx.post(
            server.api + path, json={"model": "default", **body}, headers=_auth(), timeout=60
        )
        assert _error(resp, 404)["code"] == "file_not_found"
