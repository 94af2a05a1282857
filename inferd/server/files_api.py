"""/v1/files in the shape of OpenAI's Files API (the ``openai`` SDK's ``client.files``).

    POST   /v1/files                  multipart/form-data: ``file`` (the bytes, with a
                                      filename) and ``purpose``; answers the OpenAIFile
    GET    /v1/files                  {"object": "list", "data", "first_id", "last_id",
                                      "has_more"}; ``purpose``, ``limit`` (1-10000, default
                                      10000), ``order`` (asc | desc, default desc), ``after``
    GET    /v1/files/{id}             the OpenAIFile
    GET    /v1/files/{id}/content     the bytes, as an attachment
    DELETE /v1/files/{id}             {"id", "object": "file", "deleted": true}

Files are stored by file_store.py and owned by the API key that created them: another key's
file is a 404. A multipart form is a "simple" request a web page may send across sites without
a preflight, so an upload whose ``Origin`` is not one of ``--allowed-origins`` is a 403 (as
for skills). The content is served as an attachment with ``nosniff``, so an uploaded HTML page
never runs as this server's origin.
"""

from __future__ import annotations

import asyncio
import mimetypes
from typing import Any

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferd.server.auth import request_owner
from inferd.server.envelope import header
from inferd.server.errors import APIError, bad_request
from inferd.server.file_store import UPLOAD_PURPOSES, FileStore, FileTooLarge, StoredFile
from inferd.server.skills_api import refuse_cross_site
from inferd.server.state import ServerState

MAX_LIMIT = 10000
_FIELDS = {"file", "purpose", "expires_after[anchor]", "expires_after[seconds]"}
_MULTIPART_SLACK = 64 * 1024  # the form's own bytes beside the file


def file_store(request: Request) -> FileStore:
    state: ServerState = request.app.state.inferd
    return state.files


def not_found(file_id: str, param: str = "file_id") -> APIError:
    return APIError(404, f"no file {file_id[:80]!r}", param, "file_not_found")


async def owned_file(request: Request, file_id: str, param: str = "file_id") -> StoredFile:
    """The caller's file of that id, or the 404 (another key's file is not there)."""
    record = await asyncio.to_thread(file_store(request).get, file_id, request_owner(request))
    if record is None:
        raise not_found(file_id, param)
    return record


async def create_file(request: Request) -> Response:
    store = file_store(request)
    refuse_cross_site(request)
    content_type = header(request.scope, b"content-type") or ""
    if content_type.split(";", 1)[0].strip().lower() != "multipart/form-data":
        raise APIError(
            415,
            "POST /v1/files takes multipart/form-data with the fields 'file' and 'purpose'",
            code="unsupported_media_type",
        )
    declared = header(request.scope, b"content-length")
    if declared and declared.isdigit() and int(declared) > store.max_file_bytes + _MULTIPART_SLACK:
        raise _too_large(store)
    try:
        form = await request.form(max_files=1, max_fields=len(_FIELDS))
    except HTTPException as exc:  # the multipart parser's refusal (too many parts, malformed)
        raise bad_request(f"the multipart body cannot be read: {exc.detail}", "file") from None
    try:
        unknown = sorted(set(form.keys()) - _FIELDS)
        if unknown:
            raise bad_request(f"unknown form field(s) {', '.join(unknown)[:100]}", unknown[0])
        purpose = form.get("purpose")
        if not isinstance(purpose, str) or purpose not in UPLOAD_PURPOSES:
            raise bad_request(
                f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}", "purpose", "invalid_purpose"
            )
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise bad_request("the form needs a 'file' field holding the file", "file")
        data = await upload.read(store.max_file_bytes + 1)  # no further than the limit
        filename = upload.filename or "file"
    finally:
        await form.close()
    if len(data) > store.max_file_bytes:
        raise _too_large(store)
    try:
        record = await asyncio.to_thread(
            store.put, data, filename=filename, purpose=purpose, owner=request_owner(request)
        )
    except FileTooLarge as exc:
        raise APIError(413, str(exc), "file", "file_too_large") from None
    return JSONResponse(record.body())


def _too_large(store: FileStore) -> APIError:
    message = f"the file is over this server's limit of {store.max_file_bytes} bytes"
    return APIError(413, message + " (--max-file-bytes)", "file", "file_too_large")


async def list_files(request: Request) -> Response:
    query = request.query_params
    raw = query.get("limit", str(MAX_LIMIT))
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise bad_request(f"limit must be an integer from 1 to {MAX_LIMIT}", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be asc or desc", "order")
    after = query.get("after")
    page = await asyncio.to_thread(
        file_store(request).page,
        request_owner(request),
        limit=int(raw),
        descending=order == "desc",
        purpose=query.get("purpose"),
        after=after,
    )
    if page is None:
        raise bad_request(f"after: no file {str(after)[:80]!r}", "after")
    data: list[dict[str, Any]] = [f.body() for f in page.files]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": page.has_more,
        }
    )


async def retrieve_file(request: Request) -> Response:
    record = await owned_file(request, request.path_params["file_id"])
    return JSONResponse(record.body())


async def file_content(request: Request) -> Response:
    record = await owned_file(request, request.path_params["file_id"])
    data = await asyncio.to_thread(file_store(request).content, record)
    media_type = mimetypes.guess_type(record.filename)[0] or "application/octet-stream"
    quoted = record.filename.replace("\\", "_").replace('"', "_")
    headers = {
        "Content-Disposition": f'attachment; filename="{quoted}"',
        "X-Content-Type-Options": "nosniff",
    }
    try:
        return Response(data, media_type=media_type, headers=headers)
    except UnicodeEncodeError:  # a name latin-1 cannot carry in a header
        headers["Content-Disposition"] = "attachment"
        return Response(data, media_type=media_type, headers=headers)


async def delete_file(request: Request) -> Response:
    file_id = request.path_params["file_id"]
    deleted = await asyncio.to_thread(file_store(request).delete, file_id, request_owner(request))
    if not deleted:
        raise not_found(file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})
