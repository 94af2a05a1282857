"""Approvals of the agent loop's tool calls (``--agent-permission ask``, or ``ask`` per tool).

A call that needs approval waits here, under an id, until someone answers it or the wait
times out (``--agent-approval-timeout``), when it counts as denied: the model reads that the
call was not approved, and the request completes. The waiting calls are listed and answered
over HTTP, under the API's own keys:

    GET  /v1/agent/approvals        the calls waiting: id, tool, arguments, request id, expiry
    POST /v1/agent/approvals/{id}   {"approve": true | false}; 404 when no call waits under id

Pending approvals live in memory: a restart denies them (their requests end with the server).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferd.server.errors import APIError
from inferd.server.protocol import parse_body

Decision = Literal["approved", "denied", "expired"]


@dataclass(slots=True)
class PendingApproval:
    id: str
    tool: str
    arguments: Mapping[str, Any]
    request_id: str
    created: float  # time.time()
    expires: float  # time.time()
    answer: asyncio.Future[bool]

    def listing(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "agent.approval",
            "tool": self.tool,
            "arguments": dict(self.arguments),
            "request_id": self.request_id,
            "created_at": int(self.created),
            "expires_at": int(self.expires),
        }


class ApprovalBroker:
    """The calls waiting for approval, and their answers."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.pending: dict[str, PendingApproval] = {}

    async def ask(
        self,
        tool: str,
        arguments: Mapping[str, Any],
        request_id: str,
        on_pending: Callable[[PendingApproval], None] | None = None,
    ) -> Decision:
        """Wait for an answer to a call of ``tool``; a cancelled wait (the client left) is
        withdrawn. ``on_pending``: told of the waiting call (its id) once it can be answered."""
        now = time.time()
        pending = PendingApproval(
            f"apr_{uuid.uuid4().hex[:24]}",
            tool,
            arguments,
            request_id,
            now,
            now + self.timeout_s,
            asyncio.get_running_loop().create_future(),
        )
        self.pending[pending.id] = pending
        if on_pending is not None:
            on_pending(pending)
        try:
            async with asyncio.timeout(self.timeout_s):
                return "approved" if await pending.answer else "denied"
        except TimeoutError:
            return "expired"
        finally:
            self.pending.pop(pending.id, None)

    def answer(self, approval_id: str, approve: bool) -> bool:
        """Settle a waiting call; False when none waits under ``approval_id``."""
        pending = self.pending.get(approval_id)
        if pending is None or pending.answer.done():
            return False
        pending.answer.set_result(approve)
        return True


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    approve: bool


def _broker(request: Request) -> ApprovalBroker:
    broker: ApprovalBroker = request.app.state.inferd.agent.broker
    return broker


async def list_approvals(request: Request) -> Response:
    waiting = [p.listing() for p in _broker(request).pending.values()]
    return JSONResponse({"object": "list", "data": waiting})


async def answer_approval(request: Request) -> Response:
    approval_id = request.path_params["approval_id"]
    body = parse_body(await request.body(), _Answer)
    if not _broker(request).answer(approval_id, body.approve):
        raise APIError(
            404,
            f"no tool call waits for approval under {approval_id!r} (it was answered, "
            "timed out, or its request ended)",
            param="approval_id",
            code="approval_not_found",
        )
    return JSONResponse({"id": approval_id, "object": "agent.approval", "approved": body.approve})
