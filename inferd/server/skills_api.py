"""/v1/skills: the skills of ``--skills-dir`` (agent/skills.py), in the shape of OpenAI's
Skills API (the ``openai`` SDK's ``client.skills`` speaks to it), a skill's id being its name.

    GET    /v1/skills          {"object": "list", "data": [skill...], "has_more", ...};
                               ``limit`` (1-100, default 20), ``order`` (asc | desc by
                               created_at, default desc), ``after`` (a skill's id)
    GET    /v1/skills/{id}     the skill, with ``body`` (SKILL.md after its front matter)
    POST   /v1/skills          multipart/form-data, field ``files`` (or ``files[]``, as the
                               SDK names a list): one zip archive of the skill's folder, or the
                               folder's files, each part's filename its path in the skill; 400
                               for an upload the checks refuse, 409 when the name is taken
    DELETE /v1/skills/{id}     {"id", "object": "skill.deleted", "deleted": true}

A skill here is {"id", "object": "skill", "name", "description", "created_at",
"default_version", "latest_version", "files"}: skills have no versions here (both are "1"),
and ``files`` lists the skill's files (path, bytes). The changing routes are admin routes
(server/admin.py). A multipart form is a "simple" request a web page may send across sites
without a preflight, so an upload whose ``Origin`` is not one of ``--allowed-origins`` is a
403. Without ``--skills-dir`` every route is a 404 saying so.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferd.agent.skills import (
    SkillError,
    SkillExists,
    SkillInfo,
    SkillNotFound,
    SkillStore,
    entries_from_zip,
)
from inferd.server.envelope import header
from inferd.server.errors import APIError, bad_request
from inferd.server.state import ServerState

FIELD = "files"
MAX_LIMIT = 100
DEFAULT_LIMIT = 20
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a local file header, an empty archive's end


def _store(request: Request) -> SkillStore:
    state: ServerState = request.app.state.inferd
    if state.agent.skills is None:
        raise APIError(
            404,
            "skills are off on this server (start it with --skills-dir DIR)",
            code="skills_off",
        )
    return state.agent.skills


def skill_object(store: SkillStore, info: SkillInfo) -> dict[str, Any]:
    files = [{"path": f.path, "bytes": f.size} for f in store.files(info.name)]
    return {
        "id": info.name,
        "object": "skill",
        "name": info.name,
        "description": info.description,
        "created_at": info.created_at,
        "default_version": "1",
        "latest_version": "1",
        "files": files,
    }


async def list_skills(request: Request) -> Response:
    store = _store(request)
    query = request.query_params
    limit = _limit(query.get("limit"))
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be asc or desc", "order")
    skills = await asyncio.to_thread(store.listing)
    skills.sort(key=lambda s: (s.created_at, s.name), reverse=order == "desc")
    after = query.get("after")
    if after is not None:
        ids = [s.name for s in skills]
        if after not in ids:
            raise bad_request(f"after: no skill {after[:80]!r}", "after")
        skills = skills[ids.index(after) + 1 :]
    page = skills[:limit]
    data = await asyncio.to_thread(lambda: [skill_object(store, s) for s in page])
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(skills) > limit,
        }
    )


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIMIT
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise bad_request(f"limit must be an integer from 1 to {MAX_LIMIT}", "limit")
    return int(raw)


async def get_skill(request: Request) -> Response:
    store = _store(request)
    name = request.path_params["skill_id"]

    def read() -> dict[str, Any]:
        return skill_object(store, store.info(name)) | {"body": store.body(name)}

    return JSONResponse(await _run(read))


async def delete_skill(request: Request) -> Response:
    store = _store(request)
    name = request.path_params["skill_id"]
    await _run(lambda: store.delete(name))
    return JSONResponse({"id": name, "object": "skill.deleted", "deleted": True})


async def create_skill(request: Request) -> Response:
    store = _store(request)
    refuse_cross_site(request)
    content_type = header(request.scope, b"content-type") or ""
    if content_type.split(";", 1)[0].strip().lower() != "multipart/form-data":
        raise APIError(
            415,
            f"POST /v1/skills takes multipart/form-data with the skill in the field {FIELD!r} "
            "(one zip archive, or the skill's files)",
            code="unsupported_media_type",
        )
    entries = await _upload_entries(request, store)
    info = await _run(lambda: store.create(entries))
    return JSONResponse(await asyncio.to_thread(skill_object, store, info))


async def _upload_entries(request: Request, store: SkillStore) -> list[tuple[str, bytes]]:
    """The upload's files as (path, content): a single zip unpacked (bounded), or the parts'
    filenames and contents, each read no further than the per-file limit."""
    limits = store.limits
    try:
        form = await request.form(max_files=limits.max_files + 1, max_fields=limits.max_files + 1)
    except HTTPException as exc:  # the multipart parser's refusal (too many parts, malformed)
        raise bad_request(f"the multipart body cannot be read: {exc.detail}", FIELD) from None
    try:
        unknown = sorted(set(form.keys()) - {FIELD, FIELD + "[]"})
        if unknown:
            raise bad_request(f"unknown form field(s) {', '.join(unknown)}; send {FIELD!r}", FIELD)
        parts = [*form.getlist(FIELD), *form.getlist(FIELD + "[]")]
        if not parts:
            raise bad_request(f"the form has no {FIELD!r} field holding the skill", FIELD)
        if not all(isinstance(p, UploadFile) for p in parts):
            raise bad_request(f"each {FIELD!r} part must be a file (with a filename)", FIELD)
        uploads = [p for p in parts if isinstance(p, UploadFile)]
        contents: list[bytes] = []
        left = limits.max_total_bytes  # all parts together, a zip or the files
        for upload in uploads:
            contents.append(await upload.read(left + 1))
            left -= len(contents[-1])
            if left < 0:
                raise bad_request(f"the upload is over {limits.max_total_bytes} bytes", FIELD)
    finally:
        await form.close()
    if len(uploads) == 1 and contents[0].startswith(_ZIP_MAGIC):
        return await _run(lambda: entries_from_zip(contents[0], limits))
    return [(p.filename or "", c) for p, c in zip(uploads, contents, strict=True)]


async def _run(work: Any) -> Any:
    """``work`` on a worker thread, its SkillErrors as the caller's 4xx."""
    try:
        return await asyncio.to_thread(work)
    except SkillNotFound as exc:
        raise APIError(404, str(exc), "skill_id", "skill_not_found") from None
    except SkillExists as exc:
        raise APIError(409, str(exc), FIELD, "skill_exists") from None
    except SkillError as exc:
        raise bad_request(str(exc), FIELD, "invalid_skill") from None
    except OSError as exc:  # the folder itself: not writable, full
        message = f"the skills folder cannot be used: {exc.strerror or type(exc).__name__}"
        raise APIError(503, message, code="skills_unavailable") from None


def refuse_cross_site(request: Request) -> None:
    origin = header(request.scope, b"origin")
    if origin is None:
        return
    allowed = request.app.state.inferd.options.allowed_origins
    if "*" in allowed or origin in allowed:
        return
    raise APIError(
        403,
        f"an upload from the web page at {origin[:100]!r} is refused (not in --allowed-origins)",
        code="origin_not_allowed",
    )
