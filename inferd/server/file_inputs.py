"""Files as inputs: chat's ``file`` parts and the Responses API's ``input_file`` parts (and an
``input_image`` naming a ``file_id``), by id from /v1/files or inline (``file_data``).

Each is rewritten, before any other check, into the part its kind of file already is: an image
into an image part, audio into ``input_audio`` and video into ``video_url`` (chat only), so the
media policy, the modality check and the decoder treat them as any other media; a text file
(text/*, JSON, CSV, markdown, source code...) becomes a text part holding its name and its
UTF-8 text, bounded. Any other kind is a 400 naming it; an id that is not the caller's file is
a 404 (another key's file is not there).
"""

from __future__ import annotations

import asyncio
import base64
import mimetypes
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from starlette.requests import Request

from inferd.server.auth import request_owner
from inferd.server.errors import APIError, bad_request
from inferd.server.file_store import clean_filename
from inferd.server.media import decode_inline, media_policy
from inferd.server.state import ServerState

MAX_TEXT_CHARS = 200_000  # of one text file in a prompt
_TEXT_TYPES = {
    "application/json",
    "application/xml",
    "application/yaml",
    "application/x-yaml",
    "application/javascript",
    "application/x-sh",
    "application/toml",
    "application/sql",
}
_TEXT_SUFFIXES = {
    ".txt", ".md", ".markdown", ".rst", ".json", ".jsonl", ".csv", ".tsv", ".xml", ".yaml",
    ".yml", ".toml", ".ini", ".cfg", ".log", ".py", ".js", ".ts", ".java", ".c", ".h", ".cpp",
    ".go", ".rs", ".rb", ".sh", ".sql", ".html", ".css", ".tex",
}  # fmt: skip
_AUDIO_FORMATS = {".wav": "wav", ".mp3": "mp3", ".flac": "flac", ".ogg": "ogg", ".m4a": "m4a"}
_IMAGE_MAGIC = {
    b"\x89PNG\r\n\x1a\n": "image/png",
    b"\xff\xd8\xff": "image/jpeg",
    b"GIF8": "image/gif",
    b"RIFF": "image/webp",  # checked with WEBP below
}


@dataclass(frozen=True, slots=True)
class FileInput:
    filename: str
    media_type: str
    data: bytes

    @property
    def kind(self) -> str:
        """image, audio, video, text, or "" for a kind no model here takes."""
        major = self.media_type.split("/", 1)[0]
        if major in ("image", "audio", "video"):
            return major
        if major == "text" or self.media_type in _TEXT_TYPES:
            return "text"
        return ""

    def data_url(self) -> str:
        return f"data:{self.media_type};base64,{base64.b64encode(self.data).decode()}"

    def text(self, param: str) -> str:
        try:
            text = self.data.decode("utf-8")
        except UnicodeDecodeError:
            raise bad_request(
                f"{param}: the file {self.filename!r} is not UTF-8 text", param, "invalid_file"
            ) from None
        if len(text) > MAX_TEXT_CHARS:
            text = text[:MAX_TEXT_CHARS] + f"\n[... cut at {MAX_TEXT_CHARS} characters]"
        return f"{self.filename}:\n{text}\n"


def _media_type(filename: str, declared: str | None, data: bytes) -> str:
    """The declared type, else the bytes' image signature, else the name's."""
    if declared and declared != "application/octet-stream":
        return declared.lower()
    for magic, kind in _IMAGE_MAGIC.items():
        if data.startswith(magic) and (kind != "image/webp" or data[8:12] == b"WEBP"):
            return kind
    suffix = PurePosixPath(filename).suffix.lower()
    if suffix in _TEXT_SUFFIXES:
        return "text/markdown" if suffix in (".md", ".markdown") else "text/plain"
    return mimetypes.guess_type(filename)[0] or "application/octet-stream"


async def load_file(request: Request, value: dict[str, Any], param: str) -> FileInput:
    """The file a part names: ``file_id`` (the caller's, from /v1/files) or ``file_data``."""
    state: ServerState = request.app.state.inferd
    name = value.get("filename")
    if name is not None and not isinstance(name, str):
        raise bad_request(f"{param}.filename must be a string", f"{param}.filename")
    file_id = value.get("file_id")
    if file_id is not None:
        if not isinstance(file_id, str):
            raise bad_request(f"{param}.file_id must be a string", f"{param}.file_id")
        record = await asyncio.to_thread(state.files.get, file_id, request_owner(request))
        if record is None:
            raise APIError(404, f"no file {file_id[:80]!r}", f"{param}.file_id", "file_not_found")
        data = await asyncio.to_thread(state.files.content, record)
        filename = clean_filename(name or record.filename)
        return FileInput(filename, _media_type(filename, None, data), data)
    if value.get("file_data") is None:
        raise bad_request(f"{param}: give file_id or file_data", param)
    declared, data = decode_inline(value["file_data"], media_policy(request), f"{param}.file_data")
    filename = clean_filename(name or "file")
    return FileInput(filename, _media_type(filename, declared, data), data)


def _unsupported(param: str, file: FileInput, takes: str) -> APIError:
    return bad_request(
        f"{param}: the file {file.filename!r} is {file.media_type}; a file here may be {takes}",
        param,
        "unsupported_file",
    )


# -- chat -------------------------------------------------------------------------------------


def has_file_parts(messages: list[Any]) -> bool:
    return any(
        isinstance(m.content, list)
        and any(isinstance(p, dict) and p.get("type") == "file" for p in m.content)
        for m in messages
    )


async def chat_file_part(request: Request, part: dict[str, Any], param: str) -> dict[str, Any]:
    """A chat ``file`` part as the part its kind of file is."""
    value = part.get("file")
    if not isinstance(value, dict):
        raise bad_request(f"{param}.file must be an object", f"{param}.file")
    file = await load_file(request, value, f"{param}.file")
    kind = file.kind
    if kind == "image":
        return {"type": "image_url", "image_url": {"url": file.data_url()}}
    if kind == "video":
        return {"type": "video_url", "video_url": {"url": file.data_url()}}
    fmt = _AUDIO_FORMATS.get(PurePosixPath(file.filename).suffix.lower())
    if kind == "audio" and fmt is not None:
        data = base64.b64encode(file.data).decode()
        return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}
    if kind == "text":
        return {"type": "text", "text": file.text(f"{param}.file")}
    takes = "an image, audio (wav, mp3, flac, ogg, m4a), a video or a text file"
    raise _unsupported(f"{param}.file", file, takes)


async def resolve_chat_files(request: Request, messages: list[Any]) -> None:
    """Every ``file`` part of the messages (ChatMessage) replaced, in place."""
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        parts = message.content
        for j, part in enumerate(parts):
            if isinstance(part, dict) and part.get("type") == "file":
                parts[j] = await chat_file_part(request, part, f"messages.{i}.content.{j}")


# -- responses --------------------------------------------------------------------------------


async def resolve_response_files(request: Request, items: list[dict[str, Any]]) -> None:
    """Every ``input_file`` part (and ``input_image`` by ``file_id``) of the input items
    replaced, in place: images as ``input_image``, text files as ``input_text``."""
    for i, item in enumerate(items):
        if item.get("type") != "message":
            continue
        parts = item["content"]
        for j, part in enumerate(parts):
            param = f"input.{i}.content.{j}"
            if part["type"] == "input_image" and "file_id" in part:
                file = await load_file(request, part, param)
                if file.kind != "image":
                    raise _unsupported(param, file, "an image in input_image")
                parts[j] = {"type": "input_image", "image_url": file.data_url()} | {
                    "detail": part["detail"]
                }
            elif part["type"] == "input_file":
                file = await load_file(request, part, param)
                if file.kind == "image":
                    parts[j] = {"type": "input_image", "image_url": file.data_url()}
                    parts[j]["detail"] = "auto"
                elif file.kind == "text":
                    parts[j] = {"type": "input_text", "text": file.text(param)}
                else:
                    raise _unsupported(param, file, "an image or a text file on /v1/responses")
