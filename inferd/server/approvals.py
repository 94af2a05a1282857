"""Approvals of the agent loop's tool calls (``--agent-permission ask``, or ``ask`` per tool).

A call that needs approval waits here, under an id, until someone answers it or the wait
times out (``--agent-approval-timeout``), when it counts as denied: the model reads that the
call was not approved, and the request completes. The waiting calls are listed and answered
over HTTP, under the API's own keys; with keys, a caller sees and answers only the calls of
requests made with its own key:

    GET  /v1/agent/approvals        the calls waiting: id, tool, arguments, request id, session,
                                    expiry
    POST /v1/agent/approvals/{id}   {"approve": true | false}; 404 when no call of the caller's
                                    waits under id

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

from inferd.server.auth import request_owner
from inferd.server.errors import APIError
from inferd.server.protocol import parse_body

Decision = Literal["approved", "denied", "expired"]


@dataclass(frozen=True, slots=True)
class CallOrigin:
    """Whom a tool call is made for: its request, the key's owner (None without keys), and
    the agent session the request continues, if any."""

    request_id: str
    owner: str | None = None
    session_id: str | None = None


@dataclass(slots=True)
class PendingApproval:
    id: str
    tool: str
    arguments: Mapping[str, Any]
    origin: CallOrigin
    created: float  # time.time()
    expires: float  # time.time()
    answer: asyncio.Future[bool]

    def listing(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "agent.approval",
            "tool": self.tool,
            "arguments": dict(self.arguments),
            "request_id": self.origin.request_id,
            "session_id": self.origin.session_id,
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
        origin: CallOrigin,
        on_pending: Callable[[PendingApproval], None] | None = None,
    ) -> Decision:
        """Wait for an answer to a call of ``tool``; a cancelled wait (the client left) is
        withdrawn. ``on_pending``: told of the waiting call (its id) once it can be answered."""
        now = time.time()
        pending = PendingApproval(
            f"apr_{uuid.uuid4().hex[:24]}",
            tool,
            arguments,
            origin,
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

    def waiting(self, owner: str | None, session_id: str | None = None) -> list[PendingApproval]:
        """The calls of ``owner``'s requests waiting (those of one session, if given)."""
        return [
            p
            for p in self.pending.values()
            if p.origin.owner == owner and (session_id is None or p.origin.session_id == session_id)
        ]

    def answer(self, approval_id: str, approve: bool, owner: str | None) -> bool:
        """Settle a waiting call of ``owner``'s; False when none waits under ``approval_id``."""
        pending = self.pending.get(approval_id)
        if pending is None or pending.answer.done() or pending.origin.owner != owner:
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
    waiting = [p.listing() for p in _broker(request).waiting(request_owner(request))]
    return JSONResponse({"object": "list", "data": waiting})


async def answer_approval(request: Request) -> Response:
    approval_id = request.path_params["approval_id"]
    body = parse_body(await request.body(), _Answer)
    if not _broker(request).answer(approval_id, body.approve, request_owner(request)):
        raise APIError(
            404,
            f"no tool call waits for approval under {approval_id!r} (it was answered, "
            "timed out, or its request ended)",
            param="approval_id",
            code="approval_not_found",
        )
    return JSONResponse({"id": approval_id, "object": "agent.approval", "approved": body.approve})
