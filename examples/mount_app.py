"""An application with routes of its own that mounts inferd's whole API under /ai.

    python examples/mount_app.py            # then try:
    curl localhost:8000/                                       # the app's own route
    curl localhost:8000/notes/similar -d '{"a": "cats", "b": "kittens"}'
    curl localhost:8000/notes/title -d '{"text": "Our picnic was rained out, again."}'
    curl localhost:8000/ai/v1/models                           # inferd, mounted
    openai.OpenAI(base_url="http://localhost:8000/ai/v1", api_key="...")  # any OpenAI client

The app and the mounted API share the same two engines (one chat model, one embedding model):
the app's routes call them directly from Python, the mount serves them over HTTP. Stream hooks
count the chunks each stream sends and log how it ended.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from inferd import Engine
from inferd.config import EngineConfig
from inferd.server import ServerOptions, StreamInfo, StreamSummary, build_app

log = logging.getLogger("notes")


class Pair(BaseModel):
    a: str
    b: str


class Note(BaseModel):
    text: str


def create_app(
    chat: Engine | str = "smollm2",
    embed: Engine | str = "minilm",
    options: ServerOptions | None = None,
) -> FastAPI:
    """The notes app; ``chat`` and ``embed`` are engines or model names (loaded here);
    ``options`` are those of the mounted API (api_keys, allowed_origins, max_body_bytes...)."""
    if isinstance(chat, str):  # both start loading now, in the background
        chat = Engine.from_spec(chat, engine_config=EngineConfig(max_num_seqs=4))
    if isinstance(embed, str):
        embed = Engine.from_spec(embed)
    streamed: dict[str, int] = {}  # request id -> chunks, filled by the stream hooks
    finished: list[tuple[str, str]] = []  # (request id, outcome)

    def on_chunk(info: StreamInfo, chunk: dict[str, Any]) -> None:
        streamed[info.request_id or "?"] = streamed.get(info.request_id or "?", 0) + 1

    def on_done(info: StreamInfo, summary: StreamSummary) -> None:
        finished.append((info.request_id or "?", summary.outcome))
        log.info(
            "stream %s on %s: %s, %d chunks",
            info.request_id,
            info.path,
            summary.outcome,
            len(summary.chunks),
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        for engine in (chat, embed):
            engine.shutdown()

    app = FastAPI(title="notes", lifespan=lifespan)
    app.state.streamed = streamed
    app.state.finished = finished

    @app.get("/")
    async def home() -> dict[str, Any]:
        return {
            "app": "notes",
            "ai": "/ai/v1",
            "models": {chat.id: chat.status, embed.id: embed.status},
        }

    @app.post("/notes/similar")
    async def similar(pair: Pair) -> dict[str, float]:
        result = await embed.embed([pair.a, pair.b])
        a, b = result.vectors
        return {"cosine": math.fsum(x * y for x, y in zip(a, b, strict=True))}

    @app.post("/notes/title")
    async def title(note: Note) -> dict[str, str]:
        messages = [{"role": "user", "content": f"Give a short title for: {note.text}"}]
        reply = await chat.chat(messages, max_tokens=12, temperature=0.0)
        return {"title": reply.text.strip()}

    app.mount(
        "/ai",
        build_app([chat, embed], options or ServerOptions(), on_chunk=on_chunk, on_done=on_done),
    )
    return app


if __name__ == "__main__":
    import uvicorn

    logging.basicConfig(level=logging.INFO)
    uvicorn.run(create_app(), host="127.0.0.1", port=8000)
